"""`shardwise launch <scheduler>`: the job a config describes, written for the scheduler that will run it.

slurm.py writes an sbatch script (srun + torchrun's c10d rendezvous on the allocation's first node, the warning
signal that makes the ranks save, requeue that resumes). k8s.py writes a Kubeflow Trainer TrainJob or a JobSet
(Kueue's queue label, GPUs, the run folder on a shared volume, a save on SIGTERM). local.py is the launcher behind
`shardwise train --nproc` and plays several machines on this one (`launch local`, elastic ranges included). Each
scheduler's text is checked against the real thing in the tests (a Slurm cluster on localhost; the published
Kubernetes schemas), not against a copy of the text. No torch here.
"""
