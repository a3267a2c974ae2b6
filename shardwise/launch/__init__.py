"""`shardwise launch <scheduler>`: the job a config describes, written for the scheduler that will run it.

slurm.py writes an sbatch script (srun + torchrun's c10d rendezvous on the allocation's first node, the warning
signal that makes the ranks save, requeue that resumes). Each scheduler's text is checked against the real thing
in the tests (a Slurm cluster on localhost), not against a copy of the text.
"""
