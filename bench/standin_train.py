"""The main job over the lab's stand-in backends: ``launch/train.py`` with them registered.

``bench/mainjob.py`` runs this script by path in every rank (``launch/vnodes.py ...
-- bench/standin_train.py --backend B ...``). It registers the stand-ins, ``null`` (a
group whose collectives do nothing: the model's compute alone, bench/null_pg.py) and the
floors ``floor``, ``floor_inside`` and ``floor_between`` (bench/job_floor_pg.py), then runs
``neuron_dist.launch.train`` unchanged with the same arguments, so ``--backend`` takes
them beside every backend torch knows (neuron, gloo). The installed launcher itself never
imports the lab.
"""

import os
import sys

if __name__ == "__main__":
    # Run by path, this folder is first on sys.path; the lab is imported from its parent.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from bench import job_floor_pg, null_pg
    from neuron_dist.launch import train

    null_pg.register()
    job_floor_pg.register()
    train.main()
