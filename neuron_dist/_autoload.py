"""Entry point torch calls at ``import torch`` (group ``torch.backends``).

It only registers the backend. A failure here must not break ``import torch`` for the
user, so it is reported as a warning; ``import neuron_dist`` then shows the real error.
"""

import warnings


def register() -> None:
    try:
        from .backend import register as _register

        _register()
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"neuron_dist could not register the 'neuron' backend: {exc!r}",
                      RuntimeWarning, stacklevel=2)
