"""Across nodes: what joins nodes, and groups that span them.

The rdm transport's socket driver on loopback, the between-nodes transport contract run
against rdm and MPI, the MPI transport under mpiexec, frame and store authentication,
collectives over virtual nodes (NEURON_DIST_NODE_NAME, loopback) and in network
namespaces (launch/vnodes.py: several NICs, a NIC lost mid-transfer), and survivors
shrinking a group or finishing the main job after losing nodes. The scripts these tests
launch by path (vnode_job.py, mpi_job_*.py, nic_cut_job.py, flood_victim.py) sit here.
"""
