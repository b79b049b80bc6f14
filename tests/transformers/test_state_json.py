"""The TrainerState's JSON at each save (``_state.StateJson``): the log history's entries are
encoded once, and the text is always what encoding the whole state gives, whatever changed
between saves."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest
from transformers import GPT2Config, TrainerState

from coci_transformers import _state


def _whole(state: TrainerState) -> str:
    return json.dumps(dataclasses.asdict(state), sort_keys=True)


def _state_with_history(n: int) -> TrainerState:
    state = TrainerState(global_step=n, trial_params={"lr": 0.1, "layers": [1, 2]})
    state.stateful_callbacks = {"TrainerControl": {"args": {"should_save": False}}}
    for i in range(n):
        state.log_history.append({"loss": 1.5 / (i + 1), "step": i, "epoch": i / 4})
    return state


Change = Callable[[TrainerState], Any]


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.log_history.append({"eval_loss": 0.5, "step": 9}),  # a log more
        lambda s: s.log_history[1].update(loss=9.0),  # an entry changed in place
        lambda s: s.log_history[1].update(step=1.0),  # equal, of another type
        lambda s: s.log_history[1].update(step=True),  # equal, of another type
        lambda s: s.log_history[0].update(note="x"),  # a key more
        lambda s: s.log_history[0].pop("epoch"),  # a key fewer
        lambda s: s.log_history.__setitem__(2, {"loss": 0.25, "step": 2}),  # another dict
        lambda s: s.log_history.pop(0),  # an entry fewer: the others move up
        lambda s: s.log_history.clear(),
        lambda s: s.log_history.append({"lists": [1, 2]}),  # not a plain entry
        lambda s: s.log_history.append({"nan": float("nan")}),
        lambda s: setattr(s, "global_step", 11),  # another field
        lambda s: s.stateful_callbacks["TrainerControl"]["args"].update(should_save=True),
        lambda s: setattr(s, "log_history", tuple(s.log_history)),  # not a list
    ],
)
def test_the_json_is_the_whole_encoding_after_any_change(change: Change) -> None:
    state, cache = _state_with_history(4), _state.StateJson()
    assert cache.encode(state) == _whole(state)
    change(state)
    assert cache.encode(state) == _whole(state)
    assert cache.encode(state) == _whole(state)


def test_a_nested_value_changed_in_place_is_encoded_again() -> None:
    state, cache = _state_with_history(2), _state.StateJson()
    state.log_history.append({"lists": [1, 2]})
    assert cache.encode(state) == _whole(state)
    state.log_history[-1]["lists"].append(3)
    assert cache.encode(state) == _whole(state)


def test_entries_already_encoded_are_not_encoded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A save after one more log encodes that entry alone (the history whole took 0.2 s a
    save for 10,000 entries)."""
    state, cache = _state_with_history(50), _state.StateJson()
    cache.encode(state)
    encoded: list[Any] = []
    dumps = json.dumps

    def counting(value: Any, **kwargs: Any) -> str:
        if isinstance(value, dict) and "step" in value:
            encoded.append(value)
        return dumps(value, **kwargs)

    monkeypatch.setattr(_state.json, "dumps", counting)
    monkeypatch.setattr(_state.dataclasses, "asdict", None)  # never the whole state
    state.log_history.append({"loss": 0.1, "step": 50})
    text = cache.encode(state)
    monkeypatch.undo()
    assert encoded == [{"loss": 0.1, "step": 50}]
    assert text == _whole(state)


def test_the_model_config_is_encoded_again_only_when_it_changed() -> None:
    config, cache = GPT2Config(n_layer=2), _state.StateJson()
    model = type("Model", (), {"config": config})()
    first = _state._config_json(model, cache)
    assert first == config.to_json_string()
    assert _state._config_json(model, cache) is first  # the same object and values
    config.n_layer = 3
    assert _state._config_json(model, cache) == config.to_json_string() != first
    model.config = GPT2Config(n_layer=3)  # another config object, the same values
    assert _state._config_json(model, cache) == model.config.to_json_string()
