"""The process world: who this rank is, its groups, the collectives, and what watches them.

- ``world.py``           the world from the launcher's environment, the device, init and teardown of the process group
- ``topology.py``        the (pp, dp) mesh and its process groups
- ``collective_log.py``  every collective's entry (sequence, op, size, label, user line); ``debug_collectives``;
                         each rank's record file in /dev/shm (its last collectives, read by the launcher after a
                         crash to name a desync, and while it runs to name a straggler)
- ``comm.py``            small collectives and byte counts
- ``watchdog.py``        the hang watchdog: the report that names the missing rank and where it is
- ``memory.py``          host memory: glibc's mmap threshold, peak resident memory
"""
