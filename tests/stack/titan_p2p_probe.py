"""``launch/titan.py`` with every rank's send/recv counted, for tests/stack/test_titan.py.

Runs ``launch.titan.main`` unchanged (same arguments) after wrapping the send/recv of
neuron's groups (``neuron_dist.p2p_face.PointToPoint``): ``send`` and ``recv`` count every
point-to-point operation a group issues (with TorchTitan, pipeline parallelism's
activations and gradients; nothing else sends), ``_post_net`` those that go to the
between-nodes transport instead of shared memory. Each rank writes its counts to
``$TITAN_P2P_DIR/rank<RANK>.json`` when training has ended.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch import titan  # noqa: E402
from neuron_dist.p2p_face import PointToPoint  # noqa: E402

counts = {"send": 0, "recv": 0, "net": 0}


def _counted(name: str, key: str):
    original = getattr(PointToPoint, name)

    def wrapper(self, *args, **kwargs):
        counts[key] += 1
        return original(self, *args, **kwargs)

    setattr(PointToPoint, name, wrapper)


_counted("send", "send")
_counted("recv", "recv")
_counted("_post_net", "net")


if __name__ == "__main__":
    rc = titan.main()
    out = Path(os.environ["TITAN_P2P_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps(counts))
    sys.exit(rc)
