"""A performance model of the mesh, and the deployment search of ``dsmesh plan``
(docs/PLAN.md): pure Python, no GPU.

shapes.py (the model's shape), hardware.py (GPU peaks, the kernel efficiency table, DeepEP's
and Mooncake's published rates), balance.py (EPLB balancedness), costs.py (step times of one
rank), overlap.py (two-batch overlap as the engine's schedule), simulate.py (a step-level
simulation of a rank's engines under a workload), queueing.py (waiting-time tails, step-time
mixtures, a closed loop's fixed point), search.py (steady-state scoring of every
deployment), closed_loop.py (the same at a fixed concurrency), report.py (tables,
``dsmesh up`` commands, Kubernetes overlays, the plot), validate.py (the model against
recorded runs), questions.py (the seed's questions), command.py (``dsmesh plan``).
"""
