"""One process of a ``transformers.Trainer`` run on a 2-D mesh, as transformers 5 writes it: a
tiny Llama (made from a config, ``save_pretrained`` into DIR/model) loaded with
``from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))``,
tensor-parallel over ``tp`` and sharded with FSDP2 over ``fsdp`` when it is loaded, then trained
by the Trainer with ``CociCallback``. The Trainer makes Accelerate's
``ParallelismConfig(tp_size=2, dp_shard_size=2)`` from the model (``_build_accelerator_args``).

The Trainer refuses its own checkpoints for a model sharded when loaded (``Resuming is not
supported for models sharded at load time``) unless ``save_strategy="no"`` (or
``save_only_model``): the run passes ``save_strategy="no"`` and coci saves every 2 steps.

On CPU, Accelerate refuses the ``ParallelismConfig`` under ``MULTI_CPU``
(``ParallelismConfig._validate_accelerator``); on GPUs the type is ``MULTI_GPU``.
:class:`ParallelTrainer` makes the Accelerator without the config, sets ``MULTI_GPU`` and then
attaches the config as the Accelerator's constructor does (Accelerate's own
``get_device_mesh`` and ``_validate_accelerator``): ``prepare`` then takes Accelerate's
tensor-parallel path (no DDP wrapper; the data split over the data-parallel ranks only).

Run as ``python -m tests.harness.ranks 4 tests.transformers._tp_child DIR``: three runs in the
same processes, each to step 6: one never stopped (coci saving at each epoch's end: 32
samples in batches of 4 on 2 data-parallel ranks, 4 steps an epoch), one stopped after step 4
(coci saved it), one resumed with ``resume_from_checkpoint=True``; then its last step resumed
on 4 processes tensor-parallel (``tp_size=4``, one data-parallel process). Prints ``RESULT <json>``
per process: the digests of the full model and optimizer state at the end of the first and of
the last run, the step the last resumed from, and each parameter's mesh dimensions and
placements.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    TrainerCallback,
    TrainingArguments,
)
from transformers.distributed import DistributedConfig

from coci_transformers import CociCallback
from tests.harness.states import full_digest
from tests.transformers.run import BATCH, Recording, Tokens

TOTAL, STOP = 6, 4


class ParallelTrainer(Recording):
    """A Trainer on Accelerate's tensor-parallel path on CPU (module docstring)."""

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        self._parallelism = args.pop("parallelism_config")  # the Trainer's, from the model
        return args

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        from accelerate import PartialState
        from accelerate.utils import DistributedType

        PartialState().distributed_type = DistributedType.MULTI_GPU
        state = self.accelerator.state
        state.distributed_type = DistributedType.MULTI_GPU
        state.parallelism_config = self._parallelism
        state.device_mesh = self._parallelism.get_device_mesh("cpu")
        self._parallelism._validate_accelerator(self.accelerator)


class Stop(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == STOP:
            control.should_training_stop = True


def save_model(path: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,  # tensor-parallel over up to 4 processes
        max_position_embeddings=16,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def train(
    directory: Path,
    *,
    stop: bool = False,
    resume: bool = False,
    sharded: bool = True,
    policy: str = "every_n_steps",
    tp: int = 2,
) -> dict[str, Any]:
    """A run to step 6 (``sharded``: on the 2-D mesh, in 4 processes; else on one process,
    the model loaded whole), coci saving by ``policy`` (``every_n_steps``: every 2 steps);
    the digests of its full state at the end."""
    model = LlamaForCausalLM.from_pretrained(
        directory.parent / "model",
        **(
            {"distributed_config": DistributedConfig(tp_size=tp, fsdp_size=4 // tp)}
            if sharded
            else {}
        ),
    )
    args = TrainingArguments(
        output_dir=str(directory),
        per_device_train_batch_size=BATCH,
        max_steps=TOTAL,
        use_cpu=True,
        report_to="none",
        logging_steps=2,
        seed=7,
        disable_tqdm=True,
        save_strategy="no",  # the Trainer's own refuses a model sharded when loaded
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    every = {"every_n_steps": 2} if policy == "every_n_steps" else {}
    callback = CociCallback(policy=policy, **every)
    trainer = (ParallelTrainer if sharded else Recording)(
        model=model,
        args=args,
        train_dataset=Tokens(),
        callbacks=[callback, *([Stop()] if stop else [])],
    )
    trainer.seen = []
    trainer.train(resume_from_checkpoint=True if resume else None)
    optimizer: Any = trainer.optimizer
    model_state, optim_state = get_state_dict(
        trainer.model, optimizer.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    layout = {
        name: [list(p.device_mesh.mesh_dim_names or ()), [str(x) for x in p.placements]]
        if isinstance(p, DTensor)
        else None
        for name, p in trainer.model.named_parameters()
    }
    AcceleratorState._reset_state(True)
    return {
        "start": callback.checkpointer.resumed_from if callback.checkpointer else None,
        "model": full_digest(model_state),
        "optim": full_digest(optim_state),
        "layout": layout,
        "seen": trainer.seen,
    }


def main() -> None:
    root = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        save_model(root / "model")
    dist.barrier()
    reference = train(root / "reference", policy="epoch")  # 4 steps per epoch
    train(root / "run", stop=True)
    resumed = train(root / "run", resume=True)
    train(root / "run", resume=True, tp=4)  # step 6 onto (tp 4, fsdp 1): nothing to train
    row = {"rank": rank, "reference": reference, "resumed": resumed}
    sys.stdout.write("RESULT " + json.dumps(row) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown of the process group at exit (see tests/transformers/run.py)


if __name__ == "__main__":
    main()
