"""The embedded lab: a small real cluster on this machine (network namespaces or loopback addresses, sshd,
tc-shaped links) that runs the simulated engine (``deploybench.sim``).

``cluster`` brings a lab up and down and injects faults; ``netns``/``commands`` are its plumbing,
``naming`` its names and ``state`` what it remembers between commands.
"""
