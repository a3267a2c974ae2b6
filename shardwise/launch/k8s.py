"""`shardwise launch k8s`: manifests that run a job on Kubernetes, with Kubeflow Trainer or with JobSet alone.

--kind trainjob (default): a Kubeflow Trainer v2 `TrainJob` on the `torch-distributed` runtime. The runtime starts
one pod per node and gives each torchrun's settings as PET_* variables (PET_NNODES, PET_NPROC_PER_NODE,
PET_MASTER_ADDR, PET_MASTER_PORT); the pod runs `shardwise train` with those, so torchrun's c10d rendezvous meets
on the first pod. The volumes, their mounts and the grace period go into a runtime patch (the TrainJob's own fields
cannot carry them). A TrainJob's restarts are its runtime's (a patch cannot set them): --max-restarts is refused
there, except for an elastic range, where it is torchrun's.

--kind jobset: where Kubeflow is not installed, a `JobSet` (the JobSet controller, which Kubeflow Trainer itself
builds on): one replicated Job of N indexed pods behind the headless Service JobSet makes, the rendezvous on pod 0
(`<name>-node-0-0.<name>`).

Both: a job name that is an RFC 1035 label, as the name of JobSet's headless Service must be, with room for the
pods' hostnames (`<name>-node-0-<i>`); `nvidia.com/gpu` per pod (and CPU and memory requests when given); a
memory-backed /dev/shm (NCCL and the data loader's workers outgrow the container runtime's 64 MiB); the run folder
(metrics.out_dir: checkpoints, logs) on a PersistentVolumeClaim every pod mounts; gang admission by Kueue
(`kueue.x-k8s.io/queue-name`, --queue), which admits all of a job's pods or none; `terminationGracePeriodSeconds`
long enough for a save: Kubernetes sends SIGTERM at a preemption or an eviction, the ranks finish their step, save
and exit, and the replacement pods resume from that checkpoint. An elastic range (--nodes MIN:MAX) runs `shardwise
train --nnodes MIN:MAX`: torchrun's rendezvous goes on with the pods it has. The pods start again (a preemption,
Kueue's re-admission, JobSet's failure policy, torchrun's restarts), so checkpoint.enabled and checkpoint.resume are
required: a job that started over would train from step 0.

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
MAX_LABEL = 63
"""The most characters of a DNS label: a Service's name, a pod's hostname."""
DEFAULT_RESTARTS = 3
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
"""An RFC 1123 label: a namespace's name."""
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
"""An RFC 1123 subdomain: a PersistentVolumeClaim's name (at most 253 characters)."""
_SERVICE_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
"""An RFC 1035 label: a Service's name, which JobSet gives the job's headless Service (a letter first)."""
_MEMORY = re.compile(r"(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[kMGTPE])?")
"""A Kubernetes memory quantity, e.g. 512Gi or 400G."""


def add_k8s_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", default="1", metavar="N|MIN:MAX", help="pods (one per node); MIN:MAX: elastic")
    p.add_argument("--gpus-per-node", type=int, default=8, help="nvidia.com/gpu per pod (0: a CPU job)")
    p.add_argument("--nproc-per-node", type=int, default=0, help="ranks per pod (default: one per GPU)")
    p.add_argument("--cpus-per-node", type=int, metavar="N",
                   help="CPUs each pod requests (resources.requests.cpu); default: none asked for")
    p.add_argument("--memory-per-node", metavar="QUANTITY",
                   help="memory each pod requests, e.g. 512Gi (resources.requests.memory); default: none asked for")
    p.add_argument("--image", required=True, help="a container image with shardwise installed")
    p.add_argument("--kind", choices=("trainjob", "jobset"), default="trainjob",
                   help="trainjob: Kubeflow Trainer v2 (torch-distributed runtime); jobset: JobSet alone")
    p.add_argument("--name", default="", help="the job's name, an RFC 1035 label (default: from metrics.out_dir, "
                   "with 'run-' before it where it does not start with a letter)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--queue", default="", help="Kueue LocalQueue: gang admission of all pods at once")
    p.add_argument("--volume-claim", default="", metavar="PVC",
                   help="a PersistentVolumeClaim (ReadWriteMany) every pod mounts for the run folder")
    p.add_argument("--mount", help="where the claim is mounted (default /data); metrics.out_dir must be under it")
    p.add_argument("--grace-seconds", type=int, default=300,
                   help="terminationGracePeriodSeconds: the time a pod has to save after SIGTERM")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="restarts of the whole job after a failure, 3 by default (--kind jobset: JobSet's "
                        "failurePolicy; torchrun's when elastic; a TrainJob's are its runtime's)")
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
    if args.volume_claim and (not _SUBDOMAIN.fullmatch(args.volume_claim) or len(args.volume_claim) > 253):
        raise ConfigError("--volume-claim", f"{args.volume_claim!r} is not a PersistentVolumeClaim's name (lowercase "
                          "letters, digits, '-' and '.', starting and ending alphanumeric): the pods would never "
                          "start", "give the claim as `kubectl get pvc` lists it")
    if not args.image.strip() or any(c.isspace() for c in args.image):
        raise ConfigError("--image", f"{args.image!r} is not a container image reference",
                          "give e.g. registry.example.com/shardwise:1.0")
    _check_restarts(args, cfg, nodes)
    _check_resources(args)
    if args.volume_claim and not (out_dir.is_absolute() and mount in out_dir.parents):
        raise ConfigError("metrics.out_dir", f"{out_dir} is not under the claim's mount {mount}, so the pods would "
                          "write their checkpoints where the others cannot read them",
                          f"set metrics.out_dir = '{mount}/<run>' (or --mount to the folder above it)")
    if high > 1 and not args.volume_claim:
        raise ConfigError("--volume-claim", "a job over several pods needs its run folder on storage every pod "
                          "mounts (checkpoints are written by all ranks)", "name a ReadWriteMany PersistentVolumeClaim")
    if args.grace_seconds < 30:
        raise ConfigError("--grace-seconds", f"{args.grace_seconds} s leaves no time to save",
                          "set 30 or more (the default, 300, leaves time for a step and a save)")
    name = job_name(args.name, out_dir, high)
    labels = {QUEUE_LABEL: args.queue} if args.queue else {}
    train = _train_command(args, cfg, nodes, per_node)
    # shared memory: the container runtime's /dev/shm is 64 MiB, less than NCCL's buffers and the data loader's
    # workers take; a memory-backed emptyDir counts against the pod's memory
    volumes = [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
    mounts = [{"name": "shm", "mountPath": "/dev/shm"}]
    if args.volume_claim:
        volumes.insert(0, {"name": "run", "persistentVolumeClaim": {"claimName": args.volume_claim}})
        mounts.insert(0, {"name": "run", "mountPath": str(mount)})
    resources = _resources(args)
    if args.kind == "trainjob":
        return [_train_job(args, name, labels, train, high, per_node, resources, volumes, mounts)]
    return [_job_set(args, name, labels, train, nodes, resources, volumes, mounts)]


def job_name(given: str, out_dir: PurePosixPath, pods: int) -> str:
    """--name, or one made from the run folder's name. JobSet names its headless Service after the job and each pod's
    hostname `<name>-node-0-<index>` after both: the name must be an RFC 1035 label (a Service's name) with room
    for the longest hostname in 63 characters."""
    room = MAX_LABEL - len(f"-{CONTAINER}-0-{pods - 1}")
    if given:
        if not _SERVICE_NAME.fullmatch(given):
            raise ConfigError("--name", f"{given!r} cannot name the job's Service (an RFC 1035 label: a lowercase "
                              "letter, then lowercase letters, digits and '-', ending with a letter or digit)",
                              f"set e.g. --name {_service_name(given, room) or 'run-1'}")
        if len(given) > room:
            raise ConfigError("--name", f"{given!r} has {len(given)} characters, and the pods' hostnames "
                              f"({given}-{CONTAINER}-0-{pods - 1}) may have {MAX_LABEL}",
                              f"set a --name of {room} characters or fewer")
        return given
    name = _service_name(out_dir.name, room)
    if not name:
        raise ConfigError("--name", f"no job name can be made from metrics.out_dir {out_dir}", "set --name")
    return name


def _service_name(text: str, room: int) -> str:
    """`text` made an RFC 1035 label of `room` characters at most: lowercase, '-' for the rest, 'run-' before a
    first character that is not a letter ("70b-run": a Service's name starts with a letter)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if name and not name[0].isalpha():
        name = f"run-{name}"
    return name[:room].rstrip("-")


def _check_restarts(args: argparse.Namespace, cfg: JobConfig, nodes: tuple[int, int]) -> None:
    """The job restarts (so it must resume), and --max-restarts only where it takes effect."""
    if not (cfg.checkpoint.enabled and cfg.checkpoint.resume):
        field = "checkpoint.enabled" if not cfg.checkpoint.enabled else "checkpoint.resume"
        raise ConfigError(field, "the job's pods start again after a preemption or a failure (Kueue's re-admission, "
                          "JobSet's failure policy, torchrun's restarts), and would train from step 0 without "
                          "resuming from the newest checkpoint", f"set {field} = true")
    if args.max_restarts is None:
        return
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts", f"{args.max_restarts} < 0", "give 0 or more")
    if args.kind == "trainjob" and nodes[0] == nodes[1]:
        raise ConfigError("--max-restarts", "a TrainJob's restarts are its runtime's (the ClusterTrainingRuntime's "
                          "JobSet failurePolicy, which a TrainJob cannot patch), so it would be ignored",
                          "leave it out, or use --kind jobset (or an elastic --nodes MIN:MAX: torchrun's restarts)")


def _restarts(args: argparse.Namespace) -> int:
    return DEFAULT_RESTARTS if args.max_restarts is None else args.max_restarts


def _check_resources(args: argparse.Namespace) -> None:
    if args.cpus_per_node is not None and args.cpus_per_node < 1:
        raise ConfigError("--cpus-per-node", f"{args.cpus_per_node} is not a number of CPUs",
                          "give 1 or more, or leave it out")
    memory = _MEMORY.fullmatch(args.memory_per_node or "")
    if args.memory_per_node is not None and not (memory and float(memory[1]) > 0):
        raise ConfigError("--memory-per-node", f"{args.memory_per_node!r} is not a Kubernetes memory quantity",
                          "give e.g. 512Gi or 400G")


def _resources(args: argparse.Namespace) -> dict:
    """The pod's GPUs (a limit: an extended resource's request equals it) and the CPU and memory it asks for."""
    resources = {"limits": {"nvidia.com/gpu": args.gpus_per_node}} if args.gpus_per_node else {}
    requests = {**({"cpu": args.cpus_per_node} if args.cpus_per_node else {}),
                **({"memory": args.memory_per_node} if args.memory_per_node else {})}
    return {**resources, **({"requests": requests} if requests else {})}


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
        where += ["--max-restarts", str(_restarts(args))]
    quoted = " ".join(shlex.quote(w) for w in words)
    return f"exec {quoted} " + " ".join(f'"{w}"' if "$" in w else w for w in where)


def _job_name_env() -> dict:
    """JOB_NAME, the rendezvous id: the JobSet's name (a TrainJob's JobSet has the TrainJob's), from the pod's label."""
    label = "jobset.sigs.k8s.io/jobset-name"
    return {"name": "JOB_NAME", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}


def _train_job(args, name, labels, train, nodes, per_node, resources, volumes, mounts) -> dict:
    pod = {"terminationGracePeriodSeconds": args.grace_seconds, "volumes": volumes,
           "containers": [{"name": CONTAINER, "volumeMounts": mounts}]}
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


def _job_set(args, name, labels, train, nodes: tuple[int, int], resources, volumes, mounts) -> dict:
    container = {"name": CONTAINER, "image": args.image, "command": ["/bin/sh", "-c", train],
                 "env": [_job_name_env()], "ports": [{"containerPort": RENDEZVOUS_PORT}]}
    if resources:
        container["resources"] = resources
    container["volumeMounts"] = mounts
    pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": args.grace_seconds, "containers": [container],
           "volumes": volumes}
    # a pod that saved and stopped (preemption, drain) fails its Job at once, and the JobSet restarts every pod
    # without counting it against maxRestarts: the new pods resume from the save
    stopped = {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                    "values": [STOPPED_EXIT_CODE]}}
    low, high = nodes
    # a fixed job fails at its first lost pod, and the JobSet restarts every pod. An elastic one goes on without it
    # (torchrun's rendezvous, down to MIN), and the Job replaces it, up to --max-restarts times a pod: the new pod
    # joins the rendezvous and the job grows back. With backoffLimit 0 the JobSet restarted every pod instead. Past
    # MAX - MIN pods lost for good the job is below MIN: the Job fails, and the JobSet restarts it.
    retries = ({"backoffLimitPerIndex": _restarts(args), "maxFailedIndexes": high - low} if low < high
               else {"backoffLimit": 0})
    job = {"parallelism": high, "completions": high, "completionMode": "Indexed", **retries,
           "podFailurePolicy": {"rules": [stopped]}, "template": {"spec": pod}}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": args.namespace, **({"labels": labels} if labels else {})},
        "spec": {
            # every pod restarts together (a lost rank stops the job: torchrun's rendezvous starts over)
            "failurePolicy": {"maxRestarts": _restarts(args), "rules": [
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
        check_file_to_write("--write", args.write, "job.yaml")
    text = yaml.safe_dump_all(manifests(args, cfg, nodes), sort_keys=False)
    if not args.write:
        print(text, end="")
        return 0
    Path(args.write).write_text(text)
    print(f"wrote {args.write}; apply it with: kubectl apply -f {args.write}", file=sys.stderr)
    return 0
