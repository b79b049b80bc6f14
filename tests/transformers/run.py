"""A tiny GPT-2 (built from a config, no download) trained by a real ``transformers.Trainer``
with ``CociCallback``, in the test process or as a child process:

    python -m tests.transformers.run DIR TOTAL_STEPS [KILL_AT] [--resume] [--reference DIR]
        [--coci JSON]

prints ``AT <step>`` after each optimizer step (``KILL_AT``: then waits to be killed, reading
stdin) and ``RESULT <json>`` at the end: the model and optimizer digest, the samples trained
on, the step it resumed from, and the Trainer's log history; ``--reference DIR`` first runs
the whole run in DIR, never stopped, and prints ``REFERENCE <json>``; ``--sigterm DIR`` last
runs it in DIR with SIGTERM sent to process 1 alone after step 4 (each process prints
``SIGTERM <json>``, the step it saved, and exits 143); ``--fsdp`` shards the model with FSDP2
through the Trainer (``fsdp="full_shard"``, ``fsdp_config={"version": 2}``; see
:class:`FSDP2Trainer`) in every run; ``--apart DIR`` (after the reference run) resumes
with ``output_dir`` ``DIR/node<RANK>`` (each process's own disk) and an empty ``DIR/coci``
(prints ``APART <json>``: the error, or None); ``--fallback DIR`` (may be given more than once,
after ``--apart``) resumes ``DIR/node0``'s run whose newest step is weights-only, each process
with ``dirpath`` ``DIR/node<RANK>/coci`` and the remote tier ``DIR/remote`` if there is one,
9 steps, and stops as its first step begins (prints ``FALLBACK <json>``: the step resumed, or
the error); ``--coci JSON``: ``CociCallback``'s options (default
``policy="every_n_steps"``, the Trainer's ``save_steps`` 3) in the last run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from coci_core import CociError, Preempted
from coci_transformers import CociCallback
from tests.harness.states import full_digest

SAMPLES = 32
BATCH = 4
STEPS_PER_EPOCH = SAMPLES // BATCH


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, each carrying its index (``idx``) for the test to record."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids, "idx": torch.tensor(i)}


class Recording(Trainer):
    """Records the index of every sample it trains on."""

    seen: list[int]

    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any) -> torch.Tensor:
        self.seen.extend(inputs.pop("idx").tolist())
        return super().training_step(model, inputs, *args)


class FSDP2Trainer(Recording):
    """A Trainer sharding with FSDP2 on CPU.

    With ``use_cpu=True`` Accelerate 1.15 prepares for DDP whatever FSDP plugin it is given:
    ``AcceleratorState`` switches to ``DistributedType.FSDP`` and records the plugin only for
    accelerators (``MULTI_GPU``, ``MULTI_NPU``, ...; not ``MULTI_CPU``), so the Trainer's
    ``is_fsdp_enabled`` is False and it trains with DDP. This Trainer forces the FSDP type
    and plugin once its Accelerator is made, as ``tests.accelerate.loop.force_fsdp`` does: the
    Trainer then shards the model with ``fully_shard`` (gloo)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.args.world_size < 2:
            return
        from accelerate import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        PartialState().distributed_type = DistributedType.FSDP
        self.accelerator.state.distributed_type = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = plugin
        self.is_fsdp_enabled = True


FSDP2: dict[str, Any] = {
    "fsdp": "full_shard",
    "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
}


class Marks(TrainerCallback):
    def __init__(self, kill_at: int | None) -> None:
        self.kill_at = kill_at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if args.process_index == 0:
            print(f"AT {state.global_step}", flush=True)
        if state.global_step == self.kill_at:
            sys.stdin.read()  # until killed


class Terminate(TrainerCallback):
    """Sends this process SIGTERM at the end of step ``at`` (on process ``rank`` only)."""

    def __init__(self, at: int, rank: int | None = None) -> None:
        self.at, self.rank = at, rank

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at and self.rank in (None, args.process_index):
            os.kill(os.getpid(), signal.SIGTERM)


class Resumed(TrainerCallback):
    """Ends the run (raises :class:`Resumed.Stop`) as its first step begins, once resumed."""

    class Stop(Exception):
        pass

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        raise Resumed.Stop


def say(line: str) -> None:
    """Print ``line`` to stdout in one write: the processes of a run share the pipe, and with
    ``PYTHONUNBUFFERED`` set ``print`` writes the text and its newline apart, so two processes'
    lines printed at once could join into one (a write of under ``PIPE_BUF``, 4096 bytes, to a
    pipe is never split)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=65,  # odd: FSDP2 splits the embedding rows unevenly (33 and 32)
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def arguments(directory: str | Path, total: int, **extra: Any) -> TrainingArguments:
    options: dict[str, Any] = {
        "output_dir": str(directory),
        "per_device_train_batch_size": BATCH,
        "max_steps": total,
        "use_cpu": True,
        "report_to": "none",
        "logging_steps": 2,
        "seed": 7,
        "disable_tqdm": True,
        "save_steps": 3,
        "dataloader_num_workers": 0,
        "remove_unused_columns": False,
        "eval_strategy": "no",
    }
    options.update(extra)
    return TrainingArguments(**options)


def train(
    directory: str | Path,
    total: int,
    *,
    kill_at: int | None = None,
    resume: Any = None,
    callback: CociCallback | None = None,
    extra_callbacks: tuple[TrainerCallback, ...] = (),
    in_process: bool = True,
    compute_metrics: Any = None,
    **extra: Any,
) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        callback = callback or CociCallback(policy="every_n_steps")  # save_steps 3
        trainer = (FSDP2Trainer if extra.get("fsdp") else Recording)(
            model=tiny_model(),
            args=arguments(directory, total, **extra),
            train_dataset=Tokens(),
            eval_dataset=Tokens() if extra.get("eval_strategy", "no") != "no" else None,
            callbacks=[callback, Marks(kill_at), *extra_callbacks],
            compute_metrics=compute_metrics,
        )
        trainer.seen = []
        trainer.train(resume_from_checkpoint=resume)
        opt = trainer.optimizer.state_dict()
        return {
            "sharded": all(type(p).__name__ == "DTensor" for p in trainer.model.parameters()),
            "digest": full_digest({"model": trainer.model.state_dict(), "opt": opt["state"]}),
            "seen": trainer.seen,
            "start": callback.checkpointer.resumed_from if callback.checkpointer else None,
            "log": [
                {k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k}
                for e in trainer.state.log_history
            ],
            "rank": trainer.args.process_index,
            "best_model": trainer.model.state_dict() if in_process else None,
            "best_checkpoint": trainer.state.best_model_checkpoint,
        }
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    options = FSDP2 if "--fsdp" in sys.argv else {}
    sys.argv = [a for a in sys.argv if a != "--fsdp"]
    if "--reference" in sys.argv:  # first a run never stopped, in the same processes
        at = sys.argv.index("--reference")
        reference_dir = sys.argv[at + 1]
        del sys.argv[at : at + 2]
        reference = train(reference_dir, int(sys.argv[2]), in_process=False, **options)
        say("REFERENCE " + json.dumps(reference))
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
    sigterm_dir = None
    if "--sigterm" in sys.argv:  # last, a run where rank 1 alone gets SIGTERM after step 4
        at = sys.argv.index("--sigterm")
        sigterm_dir = sys.argv[at + 1]
        del sys.argv[at : at + 2]
    if "--apart" in sys.argv:  # first, a resume where process 0 alone holds a Trainer checkpoint
        at = sys.argv.index("--apart")
        apart = Path(sys.argv[at + 1])
        del sys.argv[at : at + 2]
        rank = int(os.environ.get("RANK", "0"))
        own = CociCallback(policy="every_n_steps", dirpath=str(apart / "coci"))  # empty
        try:
            train(apart / f"node{rank}", 1, resume=True, callback=own, in_process=False)
            say("APART " + json.dumps({"rank": rank, "error": None}))
        except CociError as e:
            say("APART " + json.dumps({"rank": rank, "error": f"{type(e).__name__}: {e}"}))
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
    while "--fallback" in sys.argv:  # resumes past a newest weights-only step, on own disks
        at = sys.argv.index("--fallback")
        fallback = Path(sys.argv[at + 1])
        del sys.argv[at : at + 2]
        rank = int(os.environ.get("RANK", "0"))
        remote = str(fallback / "remote") if (fallback / "remote").is_dir() else None
        own = CociCallback(
            policy="every_n_steps", dirpath=str(fallback / f"node{rank}" / "coci"), remote=remote
        )
        row: dict[str, Any] = {"rank": rank, "dir": fallback.name}
        try:  # ends at its first step: the ranks' own directories would fail their first save
            train(
                fallback / f"node{rank}",
                9,
                resume=True,
                callback=own,
                extra_callbacks=(Resumed(),),
                in_process=False,
            )
        except CociError as e:
            row["error"] = f"{type(e).__name__}: {e}"
        except Resumed.Stop:
            row["start"] = own.checkpointer.resumed_from if own.checkpointer else None
        say("FALLBACK " + json.dumps(row))
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
    coci = None
    if "--coci" in sys.argv:
        at = sys.argv.index("--coci")
        coci = CociCallback(**{"policy": "every_n_steps", **json.loads(sys.argv[at + 1])})
        del sys.argv[at : at + 2]
    argv = [a for a in sys.argv[1:] if a != "--resume"]
    kill = int(argv[2]) if len(argv) > 2 else None
    resume = True if "--resume" in sys.argv else None
    result = train(
        argv[0],
        int(argv[1]),
        kill_at=kill,
        resume=resume,
        callback=coci,
        in_process=False,
        **options,
    )
    say("RESULT " + json.dumps(result))
    if sigterm_dir is not None:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
        try:
            train(
                sigterm_dir,
                int(argv[1]),
                extra_callbacks=(Terminate(4, rank=1),),
                in_process=False,
                **options,
            )
        except Preempted as stop:  # then it ends the process: exit status 143
            rank = int(os.environ.get("RANK", "0"))
            row = {"rank": rank, "saved": stop.step, "code": stop.code}
            say("SIGTERM " + json.dumps(row))
            raise
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # done (coci's saves are durable once train() returns); no teardown of the process
        # group at the interpreter's exit, which aborted now and then ("terminate called
        # without an active exception", exit 134), as tests/accelerate/_apply_child.py
        sys.stderr.flush()
        os._exit(0)
