"""`shardwise launch k8s`: manifests that run a job on Kubernetes, with Kubeflow Trainer or with JobSet alone.

--kind trainjob (default): a Kubeflow Trainer v2 `TrainJob` on the `torch-distributed` runtime. The runtime starts
one pod per node and gives each torchrun's settings as PET_* variables (PET_NNODES, PET_NPROC_PER_NODE,
PET_MASTER_ADDR, PET_MASTER_PORT); the pod runs `shardwise train` with those, so torchrun's c10d rendezvous meets
on the first pod. The volume, its mount and the grace period go into a runtime patch (the TrainJob's own fields
cannot carry them).

--kind jobset: where Kubeflow is not installed, a `JobSet` (the JobSet controller, which Kubeflow Trainer itself
builds on): one replicated Job of N indexed pods behind the headless Service JobSet makes, the rendezvous on pod 0
(`<name>-node-0-0.<name>`).

Both: `nvidia.com/gpu` per pod; the run folder (metrics.out_dir: checkpoints, logs) on a PersistentVolumeClaim
every pod mounts; gang admission by Kueue (`kueue.x-k8s.io/queue-name`, --queue), which admits all of a job's pods
or none; `terminationGracePeriodSeconds` long enough for a save: Kubernetes sends SIGTERM at a preemption or an
eviction, the ranks finish their step, save and exit, and the replacement pods resume from that checkpoint.
An elastic range (--nodes MIN:MAX) runs `shardwise train --nnodes MIN:MAX`: torchrun's rendezvous goes on with the
pods it has.

The manifests are checked in the tests against the published API models of Kubeflow Trainer (which include
JobSet's) and the core Kubernetes schemas, field by field; no cluster is needed to write them.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path, PurePosixPath

import yaml

from shardwise.config import JobConfig, check_file_to_write, fit_nodes, load_config
from shardwise.errors import ConfigError
from shardwise.launch.local import node_range, ranks_per_node

RUNTIME = "torch-distributed"
"""Kubeflow Trainer's ClusterTrainingRuntime for PyTorch (torchrun)."""
CONTAINER = "node"
"""The container (and replicated job) name in the torch-distributed runtime, kept for the JobSet too."""
RENDEZVOUS_PORT = 29500
DEFAULT_MOUNT = "/data"
"""Where the run folder's claim is mounted unless --mount says otherwise."""
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
STOPPED_EXIT_CODE = 75
"""A pod whose ranks were stopped by SIGTERM and saved exits with this (EX_TEMPFAIL, "try again"), not 0: a Job
counts an exit 0 as that index done. The JobSet's policies turn it into a restart of every pod from the save."""
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def add_k8s_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", default="1", metavar="N|MIN:MAX", help="pods (one per node); MIN:MAX: elastic")
    p.add_argument("--gpus-per-node", type=int, default=8, help="nvidia.com/gpu per pod (0: a CPU job)")
    p.add_argument("--nproc-per-node", type=int, default=0, help="ranks per pod (default: one per GPU)")
    p.add_argument("--image", required=True, help="a container image with shardwise installed")
    p.add_argument("--kind", choices=("trainjob", "jobset"), default="trainjob",
                   help="trainjob: Kubeflow Trainer v2 (torch-distributed runtime); jobset: JobSet alone")
    p.add_argument("--name", default="", help="the job's name (default: from metrics.out_dir)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--queue", default="", help="Kueue LocalQueue: gang admission of all pods at once")
    p.add_argument("--volume-claim", default="", metavar="PVC",
                   help="a PersistentVolumeClaim (ReadWriteMany) every pod mounts for the run folder")
    p.add_argument("--mount", help="where the claim is mounted (default /data); metrics.out_dir must be under it")
    p.add_argument("--grace-seconds", type=int, default=300,
                   help="terminationGracePeriodSeconds: the time a pod has to save after SIGTERM")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of the whole job after a failure (JobSet's failurePolicy; torchrun's when elastic)")
    p.add_argument("--write", metavar="PATH", help="write the manifests (YAML) there; default: print them")
    p.set_defaults(run=run_k8s)


def manifests(args: argparse.Namespace, cfg: JobConfig, nodes: tuple[int, int]) -> list[dict]:
    """The objects to apply, every input checked first."""
    low, high = nodes
    per_node = args.nproc_per_node or args.gpus_per_node
    out_dir = PurePosixPath(cfg.metrics.out_dir)
    mount = PurePosixPath(args.mount or DEFAULT_MOUNT)
    if not mount.is_absolute():
        raise ConfigError("--mount", f"{mount} is relative (a container's mountPath is absolute)",
                          "give an absolute path such as /data")
    if args.mount is not None and not args.volume_claim:  # it was ignored
        raise ConfigError("--mount", "where the claim is mounted, and no --volume-claim is given",
                          "name the PersistentVolumeClaim with --volume-claim, or leave --mount out")
    for flag, value in (("--namespace", args.namespace), ("--queue", args.queue)):
        if value and (not _NAME.fullmatch(value) or len(value) > 63):  # RFC 1123 labels, as Kubernetes names them
            raise ConfigError(flag, f"{value!r} is not a Kubernetes name (at most 63 lowercase letters, digits and "
                              "'-', starting and ending alphanumeric)", f"give the {flag[2:]} as kubectl lists it")
    if not args.image.strip() or any(c.isspace() for c in args.image):
        raise ConfigError("--image", f"{args.image!r} is not a container image reference",
                          "give e.g. registry.example.com/shardwise:1.0")
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts", f"{args.max_restarts} < 0", "give 0 or more")
    if args.volume_claim and not (out_dir.is_absolute() and mount in out_dir.parents):
        raise ConfigError("metrics.out_dir", f"{out_dir} is not under the claim's mount {mount}, so the pods would "
                          "write their checkpoints where the others cannot read them",
                          f"set metrics.out_dir = '{mount}/<run>' (or --mount to the folder above it)")
    if high > 1 and not args.volume_claim:
        raise ConfigError("--volume-claim", "a job over several pods needs its run folder on storage every pod "
                          "mounts (checkpoints are written by all ranks)", "name a ReadWriteMany PersistentVolumeClaim")
    if args.grace_seconds < 30:
        raise ConfigError("--grace-seconds", f"{args.grace_seconds} s leaves no time to save", "set 60 or more")
    name = args.name or re.sub(r"[^a-z0-9-]+", "-", out_dir.name.lower()).strip("-")[:50]
    if not _NAME.fullmatch(name):
        raise ConfigError("--name", f"{name!r} is not a Kubernetes name (lowercase letters, digits, '-')",
                          "set --name")
    if len(name) > 50:  # the pods' names add the replicated job's and their indices to it
        raise ConfigError("--name", f"{name!r} has {len(name)} characters, more than 50", "set a shorter --name")
    labels = {QUEUE_LABEL: args.queue} if args.queue else {}
    train = _train_command(args, cfg, nodes, per_node)
    volumes, mounts = [], []
    if args.volume_claim:
        volumes = [{"name": "run", "persistentVolumeClaim": {"claimName": args.volume_claim}}]
        mounts = [{"name": "run", "mountPath": str(mount)}]
    resources = {"limits": {"nvidia.com/gpu": args.gpus_per_node}} if args.gpus_per_node else {}
    if args.kind == "trainjob":
        return [_train_job(args, name, labels, train, high, per_node, resources, volumes, mounts)]
    return [_job_set(args, name, labels, train, high, resources, volumes, mounts)]


def _train_command(args: argparse.Namespace, cfg: JobConfig, nodes: tuple[int, int], per_node: int) -> str:
    """`shardwise train` for one pod, torchrun's settings from the environment the pod is given."""
    low, high = nodes
    config = ["--config", str(PurePosixPath(args.config))] if args.config else []
    words = ["shardwise", "train", *config, *[f"--set={o}" for o in args.overrides],
             "--stopped-exit-code", str(STOPPED_EXIT_CODE)]
    if args.kind == "trainjob":  # Kubeflow's torch plugin sets PET_* for torchrun; the job's name too
        where = ["--nproc", "$PET_NPROC_PER_NODE", "--nnodes", f"{low}:{high}" if low < high else "$PET_NNODES",
                 "--rdzv-endpoint", "$PET_MASTER_ADDR:$PET_MASTER_PORT", "--rdzv-id", "$JOB_NAME"]
    else:  # JobSet's headless Service names pod 0 of the replicated job
        where = ["--nproc", str(per_node), "--nnodes", f"{low}:{high}" if low < high else str(high),
                 "--rdzv-endpoint", f"$JOB_NAME-{CONTAINER}-0-0.$JOB_NAME:{RENDEZVOUS_PORT}", "--rdzv-id", "$JOB_NAME"]
    if low < high:
        where += ["--max-restarts", str(args.max_restarts)]
    quoted = " ".join(shlex.quote(w) for w in words)
    return f"exec {quoted} " + " ".join(f'"{w}"' if "$" in w else w for w in where)


def _job_name_env() -> dict:
    """JOB_NAME, the rendezvous id: the JobSet's name (a TrainJob's JobSet has the TrainJob's), from the pod's label."""
    label = "jobset.sigs.k8s.io/jobset-name"
    return {"name": "JOB_NAME", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}


def _train_job(args, name, labels, train, nodes, per_node, resources, volumes, mounts) -> dict:
    pod = {"terminationGracePeriodSeconds": args.grace_seconds}
    if volumes:
        pod["volumes"] = volumes
    container = {"name": CONTAINER, "volumeMounts": mounts} if mounts else None
    if container:
        pod["containers"] = [container]
    trainer = {"image": args.image, "command": ["/bin/sh", "-c", train], "numNodes": nodes,
               "numProcPerNode": per_node, "env": [_job_name_env()]}
    if resources:
        trainer["resourcesPerNode"] = resources
    patch = {"manager": "shardwise", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": CONTAINER, "template": {"spec": {"template": {"spec": pod}}}}]}}}}
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": name, "namespace": args.namespace, **({"labels": labels} if labels else {})},
        "spec": {"runtimeRef": {"name": RUNTIME, "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime"},
                 "trainer": trainer, "runtimePatches": [patch]},
    }


def _job_set(args, name, labels, train, nodes, resources, volumes, mounts) -> dict:
    container = {"name": CONTAINER, "image": args.image, "command": ["/bin/sh", "-c", train],
                 "env": [_job_name_env()], "ports": [{"containerPort": RENDEZVOUS_PORT}]}
    if resources:
        container["resources"] = resources
    if mounts:
        container["volumeMounts"] = mounts
    pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": args.grace_seconds, "containers": [container]}
    if volumes:
        pod["volumes"] = volumes
    # a pod that saved and stopped (preemption, drain) fails its Job at once, and the JobSet restarts every pod
    # without counting it against maxRestarts: the new pods resume from the save
    stopped = {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                    "values": [STOPPED_EXIT_CODE]}}
    job = {"parallelism": nodes, "completions": nodes, "completionMode": "Indexed", "backoffLimit": 0,
           "podFailurePolicy": {"rules": [stopped]}, "template": {"spec": pod}}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": args.namespace, **({"labels": labels} if labels else {})},
        "spec": {
            # every pod restarts together (a lost rank stops the job: torchrun's rendezvous starts over)
            "failurePolicy": {"maxRestarts": args.max_restarts, "rules": [
                {"name": "stoppedAndSaved", "action": "RestartJobSetAndIgnoreMaxRestarts",
                 "onJobFailureReasons": ["PodFailurePolicy"]}]},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [{"name": CONTAINER, "replicas": 1, "template": {"spec": job}}],
        },
    }


def run_k8s(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    nodes = node_range(args.nodes, "--nodes")
    per_node = ranks_per_node(args.gpus_per_node, args.nproc_per_node)
    fit_nodes(cfg, per_node, nodes)
    if args.write:
        check_file_to_write("--write", args.write)
    text = yaml.safe_dump_all(manifests(args, cfg, nodes), sort_keys=False)
    if not args.write:
        print(text, end="")
        return 0
    Path(args.write).write_text(text)
    print(f"wrote {args.write}; apply it with: kubectl apply -f {args.write}", file=sys.stderr)
    return 0
