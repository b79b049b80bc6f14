"""The Trainer's 2-D recipe of transformers 5: a model tensor-parallel and FSDP2-sharded when it
is loaded (``from_pretrained(path, distributed_config=DistributedConfig(tp_size=2,
fsdp_size=2))``), trained by the Trainer with ``CociCallback`` on 4 processes (gloo), stopped
after step 4 and resumed (``tests/transformers/_tp_child.py``, which also says how the Trainer
is brought onto Accelerate's tensor-parallel path on CPU). One launch: the run never stopped,
the stopped one and the resumed one run in the same 4 processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

from coci_core import CheckpointManager
from coci_transformers.export import export_step
from tests.harness.processes import child_env, module, run
from tests.harness.results import result_rows
from tests.harness.states import full_digest
from tests.transformers._tp_child import TOTAL, train


@pytest.mark.slow
@pytest.mark.dist
def test_a_model_sharded_when_loaded_resumes_bit_identical_and_exports_whole(
    tmp_path: Path,
) -> None:
    """Each process saves its own pieces of the 2-D DTensors (the model's weights were put back
    whole, with ``load_state_dict``, into DTensor parameters before: the resume failed with
    "got mixed torch.Tensor and DTensor"); the resumed run ends bit-identical to the one never
    stopped; ``policy="epoch"`` saves at the epoch's end, its steps counted with the 2
    data-parallel ranks (with 4 processes, before: at step 2); the export writes the weights
    whole, as the full state of that run; the checkpoint resumes on one process, the model
    loaded whole, to that same full state; resumed on 4 processes on another mesh, where the
    processes share their batches otherwise, it says that the data position is not the saved
    run's."""
    command = module("tests.harness.ranks", "4", "tests.transformers._tp_child")
    done = run([*command, str(tmp_path)], env=child_env({"OMP_NUM_THREADS": "1"}), timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["rank"]: row for row in result_rows(done.stdout)}
    # step 6 resumed on as many processes on another mesh (tp 4): the Trainer's batches differ
    said = [line for line in done.stderr.splitlines() if "data-parallel processes" in line]
    assert len(said) == 1 and "saved with 2 data-parallel" in said[0], said
    assert "this run has 1, on as many processes" in said[0]
    assert sorted(rows) == [0, 1, 2, 3]
    for row in rows.values():
        reference, resumed = row["reference"], row["resumed"]
        assert reference["layout"]["model.embed_tokens.weight"][0] == ["fsdp", "tp"]
        assert resumed["start"] == 4
        assert resumed["layout"] == reference["layout"]
        assert (resumed["model"], resumed["optim"]) == (reference["model"], reference["optim"])
        assert resumed["seen"] == reference["seen"][-len(resumed["seen"]) :]
    # policy="epoch" saved at the epoch's end, 4 steps of 2 data-parallel ranks (not 2 steps,
    # counted with 4 processes each taking its own batches), and at the last step
    with CheckpointManager(tmp_path / "reference" / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [4, TOTAL]
    with CheckpointManager(tmp_path / "run" / "coci", keep_last=None) as mgr:
        manifest = mgr.manifest(TOTAL)
    entries = {e.key: e for e in manifest.tensors}
    pieces = entries["/model/model.embed_tokens.weight"].pieces
    assert sorted(p.file for p in pieces) == [f"data-r{r}.bin" for r in range(4)]
    assert sum(p.length for p in pieces) == 64 * 32 * 4  # each byte written once
    exported = tmp_path / "exported"
    export_step(str(tmp_path / "run" / "coci"), exported, TOTAL)
    weights = load_file(exported / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape == (64, 32)
    assert full_digest(weights) == rows[0]["reference"]["model"]

    # onto one process, the model loaded whole: step 6 restored, nothing left to train
    AcceleratorState._reset_state(True)
    one = train(tmp_path / "run", resume=True, sharded=False)
    assert one["start"] == TOTAL and one["seen"] == []
    assert (one["model"], one["optim"]) == (
        rows[0]["reference"]["model"],
        rows[0]["reference"]["optim"],
    )
