"""``--tensor-parallel-size`` and ``--data-parallel-size`` of ``specdec generate``, ``serve`` and ``bench``: their
checks (numbers, devices, heads that split) and the launch of tensor-parallel ranks (docs/parallel.md).

Tensor parallelism runs one process per rank, as ``torchrun`` does: under ``torchrun --nproc-per-node N`` (RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) the command joins the group and runs as its rank; started plainly
it starts its N ranks itself (``python -m specdec.cli`` with the same arguments and those variables) and waits
for them. Every rank runs the same command on the same inputs; rank 0's output is the command's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from specdec.cli.checks import UsageError, check_positive

TP_FLAG, DP_FLAG = "--tensor-parallel-size", "--data-parallel-size"
_GROUP_TIMEOUT = timedelta(minutes=30)  # a rank may wait that long for another's model load or a slow step
_QUIET_ON_OTHER_RANKS = ("json_out", "json", "plot")  # files only rank 0 writes
RANK_GRACE_SECONDS = 10.0  # how long an ended command waits for each rank to stop before killing it


def add_parallel_args(p, replicas: bool = True) -> None:
    """``--tensor-parallel-size`` and ``--data-parallel-size``; ``replicas`` False: a command that runs one engine,
    whose help says that only 1 is accepted (``check_parallel`` refuses more, naming ``serve``)."""
    p.add_argument(TP_FLAG, "-tp", dest="tensor_parallel_size", type=int, default=1,
                   help="split the models over N processes (Megatron-style; gloo on the CPU, NCCL with one GPU a "
                        "rank on CUDA): started by this command, or run it under torchrun --nproc-per-node N")
    p.add_argument(DP_FLAG, "-dp", dest="data_parallel_size", type=int, default=1,
                   help="engine replicas: M processes behind one server, one GPU each on CUDA" if replicas else
                   "1 only: this command runs one engine (replicas: specdec serve --data-parallel-size M)")


def check_parallel(args, device: str, command: str) -> None:
    """UsageError naming the flag when the sizes are not positive, when ``command`` does not run replicas, or when
    this machine cannot hold them (the GPUs needed, naming the numbers)."""
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    check_positive(TP_FLAG, tp)
    check_positive(DP_FLAG, dp)
    if dp > 1 and command != "serve":
        raise UsageError(DP_FLAG, f"replicas serve many requests: use `specdec serve {DP_FLAG} {dp}` (and "
                                  f"`specdec bench-serve` to load it); `specdec {command}` runs one engine, got {dp}")
    if tp > 1 and not device.startswith(("cpu", "cuda")):
        raise UsageError(TP_FLAG, f"> 1 runs on the CPU (gloo) or CUDA (NCCL, one GPU a rank), got --device {device}")
    if device.startswith("cuda") and dp * tp > 1:
        import torch

        if ":" in device:
            raise UsageError("--device", f"{device!r} names one GPU; replicas take cuda:0 .. cuda:{dp * tp - 1}: "
                                         f"pass --device cuda")
        have = torch.cuda.device_count()
        if dp * tp > have:
            raise UsageError(DP_FLAG, f"{dp} replicas x {tp} GPUs each need {dp * tp} GPUs; this machine has {have}")


def check_split_before_loading(flag: str, name: str, size: int) -> None:
    """For a Hugging Face folder, the tensor-parallel split check on its config.json (no weights read): UsageError
    naming --tensor-parallel-size and the model's numbers. Other forms are checked when their rank loads them."""
    if size == 1 or not (Path(name).expanduser() / "config.json").is_file():
        return
    from specdec.config import ModelConfig
    from specdec.errors import FieldError
    from specdec.loading.hf import read_hf_config
    from specdec.models.tensor_parallel import check_split

    try:
        cfg = ModelConfig.from_hf(read_hf_config(Path(name).expanduser()))
        check_split(cfg, size, "draft" if flag == "--draft" else "target")
    except FieldError as err:
        raise UsageError(TP_FLAG, str(err)) from None


def build_engine(draft, target, config):
    """``SpecEngine(draft, target, config)``; a model that does not split over the ranks is a UsageError naming
    --tensor-parallel-size (and the model's numbers)."""
    from specdec.engine import SpecEngine
    from specdec.errors import FieldError

    try:
        return SpecEngine(draft, target, config)
    except FieldError as err:
        if err.field != "tensor_parallel_size":
            raise
        raise UsageError(TP_FLAG, str(err)) from None


def start_tensor_parallel(args, model: str, draft: str) -> int | None:
    """``check_split_before_loading`` of ``model`` and ``draft``, then ``launch_tensor_parallel(args)``: what
    ``generate``, ``bench`` and ``serve`` do before loading a model (None: go on as this rank)."""
    check_split_before_loading("--model", model, args.tensor_parallel_size)
    check_split_before_loading("--draft", draft, args.tensor_parallel_size)
    return launch_tensor_parallel(args)


def launch_tensor_parallel(args) -> int | None:
    """Run the command on its tensor-parallel ranks. Inside a group's process (torchrun's or ours): join the group (gloo
    on the CPU, NCCL on CUDA with GPU LOCAL_RANK current) and return None, so that the caller goes on as this rank
    (ranks other than 0 print nothing and write no files). Otherwise: start the ranks, wait, and return the command's
    exit status (0 when every rank ended 0, else the first failing rank's, after its error output)."""
    size = args.tensor_parallel_size
    if size == 1:
        return None
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _join_group(args, size)
        return None
    return start_ranks([sys.executable, "-m", "specdec.cli", *args.argv], size)


def _join_group(args, size: int) -> None:
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != size:
        raise UsageError(TP_FLAG, f"is {size} but the launcher started {world} processes (torchrun --nproc-per-node "
                                  f"must equal it)")
    if not dist.is_initialized():
        from specdec.cli.common import device_dtype

        if device_dtype(args)[0].startswith("cuda"):  # NCCL, this rank on GPU LOCAL_RANK (torchrun's, or ours)
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
            dist.init_process_group("nccl", timeout=_GROUP_TIMEOUT)
        else:
            dist.init_process_group("gloo", timeout=_GROUP_TIMEOUT)
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this process
        for name in _QUIET_ON_OTHER_RANKS:
            if getattr(args, name, None):
                setattr(args, name, None)


def start_ranks(command: list[str], size: int) -> int:
    """``size`` processes running ``command`` as ranks 0..size-1 of a local group (torchrun's environment variables):
    rank 0's output goes to this terminal, the others' error output only when they fail. A rank that fails ends the
    others (they would wait for it in a collective). The exit status: 0, or the first failing rank's; 130 after an
    interrupt (Ctrl-C), 128 + N after signal N asks the command to stop (SIGTERM from a service manager, SIGHUP
    from a closed terminal): either ends every rank first. On Linux a rank also ends when this process dies without
    ending it (killed), so no rank outlives the command holding its port or its memory."""
    import signal
    import tempfile
    import time

    from specdec.cli.common import cpu_threads
    from specdec.parallel import free_port

    port, threads = free_port(), str(max(1, cpu_threads() // size))
    procs, logs = [], []
    stopped, preexec = _StopOnSignals(signal.SIGTERM, signal.SIGHUP), _end_with_parent()
    try:
        for rank in range(size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size),
                       LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env.setdefault("OMP_NUM_THREADS", threads)
            log = tempfile.TemporaryFile("w+") if rank else None
            logs.append(log)
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL if rank else None, stderr=log,
                                          preexec_fn=preexec))
        while True:
            codes = [p.poll() for p in procs]  # (every process polled: a list, not a short-circuiting any())
            if all(c is not None for c in codes) or any(codes):
                break
            time.sleep(0.1)
        status = None
    except KeyboardInterrupt:  # Ctrl-C (a terminal sends it to every rank too): the ranks end, the command quietly
        status = 130
    except _Stopped as stop:
        status = 128 + stop.signum
    finally:
        stopped.restore()
        _end_ranks(procs)
    try:
        return status if status is not None else _exit_status([p.returncode for p in procs], logs)
    finally:
        for log in logs[1:]:
            log.close()


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


class _StopOnSignals:
    """While the launcher waits, the given signals raise ``_Stopped`` (their default would end this process alone and
    leave its ranks running); ``restore`` puts the earlier handlers back. A signal this process inherited as ignored
    stays ignored, as a shell's ``nohup`` asks."""

    def __init__(self, *signums) -> None:
        import signal
        import threading

        self._old = {}
        if threading.current_thread() is not threading.main_thread():
            return  # (only the main thread sets handlers; a launcher called elsewhere keeps the defaults)
        for signum in signums:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                self._old[signum] = signal.signal(signum, self._raise)

    @staticmethod
    def _raise(signum, frame):
        raise _Stopped(signum)

    def restore(self) -> None:
        import signal

        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        self._old = {}


def _end_with_parent():
    """A rank's ``preexec_fn`` on Linux: the kernel sends the rank SIGTERM when the launcher dies (prctl
    PR_SET_PDEATHSIG), whatever kills it; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1

    def preexec() -> None:
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    return preexec


def _exit_status(codes: list[int], logs: list) -> int:
    """The command's status from its ranks' exit codes: 0, or the first failing rank's (its error output, kept in
    ``logs``, shown here: rank 0 printed its own); 1 when a rank was killed by a signal and none failed."""
    failed = next((r for r, c in enumerate(codes) if c > 0), None)  # (< 0: a signal, ours or another's)
    if failed:
        logs[failed].seek(0)
        print(f"[rank {failed}] {logs[failed].read().rstrip()}", file=sys.stderr)
    if failed is None and any(codes):
        print(f"error: a tensor-parallel rank was killed (exit codes {codes})", file=sys.stderr)
        return 1
    return 0 if failed is None else codes[failed]


def _end_ranks(procs: list) -> None:
    """End the ranks still running, rank 0 first: its server shuts down and tells the other ranks to stop while they
    still listen (ended together, rank 0's last broadcast could wait on a rank already gone). A rank that has not
    ended ``RANK_GRACE_SECONDS`` after being asked to is killed, so an interrupt always ends the command."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=RANK_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
