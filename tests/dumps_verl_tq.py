"""verl's newer RolloutSkip dumps written as their writers write them, by code (never hand-edited bytes).

* ``skip.rollout_tq`` (verl-project/verl@1dda039b ``verl/utils/skip/rollout_skip.py`` ``RolloutTqSkip.prepare_data``):
  ``{project}/{step}/{inner}/tq_batch.pt`` = ``torch.save({"tensordict": td, "tags": [...], "keys": [...],
  "global_steps": step})`` + ``meta.json``. ``td`` is what TransferQueue's ``kv_batch_get`` returns
  (Ascend/TransferQueue@b75d570d ``_merge_tensors_to_tensordict``): per field, fields sorted, a jagged nested
  tensor (``torch.nested.as_nested_tensor(layout=torch.jagged)``, real torch), 0-d values stacked, anything else a
  ``NonTensorStack`` of ``NonTensorData``. The trajectories are ``AgentLoopOutput.as_dict()`` + the dataset's keys
  (``verl/trainer/ppo/v1/agent_loop_tq.py`` ``_agent_loop_postprocess``), keys ``{uid}_{session_id}_{index}``.
  tensordict itself is not imported: stand-ins pickle under its names as tensordict 0.10.0 does
  (``tensordict/_reductions.py`` ``_reduce_td`` -> ``_make_td(TensorDict, __getstate__())``; ``NonTensorStack`` /
  ``NonTensorData`` by ``NEWOBJ`` + ``BUILD`` of ``LazyStackedTensorDict.__dict__`` / tensorclass ``_getstate``).
  The byte layout was checked against a file torch.save'd with the real tensordict 0.10.0.
* ``skip.async_rollout`` (same file, ``AsyncRolloutSkip``): ``RolloutSkip.prepare_data`` on one prompt's ``n``
  samples, folder = the rollouter feed index of ``uid_sample_{epoch}_{index}``, written with the gen_batch
  generator of ``dumps_skyrl_verl`` and the async uid.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import dumps_skyrl_verl as g
import numpy as np

CONFIG, E, K, LAYERS = g.CONFIG, g.E, g.K, g.LAYERS


# ---- tensordict stand-ins (pickled under tensordict 0.10.0's names) --------------------------------------------
def _make_td(cls, state):  # never called here: it only gives pickle the name tensordict._reductions._make_td
    raise AssertionError("stand-in")


class TensorDict:
    """Pickles as tensordict's ``_reduce_td`` (non-consolidated): ``_make_td(TensorDict, self.__dict__)``."""

    def __init__(self, fields: dict[str, Any], batch_size: tuple[int, ...], state_extra: dict | None = None):
        import torch

        self.state = {"_tensordict": fields, "_batch_size": torch.Size(batch_size), "_device": None,
                      "_td_dim_names": None, **(state_extra or {})}

    def __reduce__(self):
        return (_make_td, (TensorDict, self.state))


class NonTensorData:
    """tensorclass ``_getstate``: ``{"tensordict": TensorDict({}, []), "non_tensordict": {"data": value, ...}}``."""

    def __init__(self, data: Any):
        self._state = {"tensordict": TensorDict({}, ()), "non_tensordict": {"data": data, "_metadata": None,
                                                                           "_is_non_tensor": True}}

    def __getstate__(self):
        return self._state


class NonTensorStack:
    """``LazyStackedTensorDict.__dict__`` pickled by ``NEWOBJ`` + ``BUILD``."""

    def __init__(self, *values: Any):
        import torch

        self._state = {"_is_locked": None, "stack_dim": 0, "_batch_size": torch.Size([len(values)]),
                       "tensordicts": [NonTensorData(v) for v in values], "hook_out": None, "hook_in": None}

    def __getstate__(self):
        return self._state


@contextlib.contextmanager
def tensordict_names():
    with contextlib.ExitStack() as st:
        st.enter_context(g._fake_modules("tensordict._reductions", _make_td=_make_td))
        st.enter_context(g._fake_modules("tensordict._td", TensorDict=TensorDict))
        st.enter_context(g._fake_modules("tensordict.tensorclass", NonTensorStack=NonTensorStack,
                                         NonTensorData=NonTensorData))
        yield


# ---- one mini-batch -------------------------------------------------------------------------------------------------
def _merge(trajs: list[dict[str, Any]], dense: bool = False) -> TensorDict:
    """``_merge_tensors_to_tensordict``: fields sorted; tensors jagged (0-d stacked), others a NonTensorStack.
    ``dense``: equal-length tensor fields stacked ([B, ...], as list_of_dict_to_tensordict would)."""
    import torch

    out: dict[str, Any] = {}
    for key in sorted(trajs[0]):
        vals = [t[key] for t in trajs]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            out[key] = NonTensorStack(*vals)
        elif all(v.dim() == 0 for v in vals) or (dense and all(v.shape == vals[0].shape for v in vals)):
            out[key] = torch.stack(vals)
        else:
            out[key] = torch.nested.as_nested_tensor(vals, layout=torch.jagged)
    return TensorDict(out, (len(trajs),))


def tq_trajectories(rng: np.random.Generator, groups: int, n: int, *, case: str = "clean"
                    ) -> tuple[list[str], list[dict], list[dict], list[dict]]:
    """``(keys, fields, tags, truth)`` of ``groups`` prompts x ``n`` sessions, as ``_agent_loop_postprocess`` puts
    them (unpadded; ``routed_experts`` [P+R, L, K] int16 zero past the captured rows; reward on the last token)."""
    import torch

    keys, fields, tags, truth = [], [], [], []
    for gi in range(groups):
        uid = f"{rng.integers(1 << 60):016x}"  # a uuid4 hex: no underscores
        P = int(rng.integers(2, 7))
        pt = rng.integers(4, 388, P)
        for s in range(n):
            j = len(keys)
            R = int(rng.integers(2, 7)) if j != 1 else 6
            rt = rng.integers(4, 388, R)
            m = np.ones(R, np.int64)
            if j % 3 == 1:
                m[1:3] = 0  # tool output inside the response
            lp = -rng.random(R).astype(np.float32)
            reward = float(j % 2)
            captured = P + R - 1 - (1 if case == "short_capture" and j == 2 else 0)
            r = g.routes(rng, captured)
            rex = np.zeros((P + R, LAYERS, K), np.int16)
            rex[:captured] = r
            rm = np.zeros(R, np.float32)
            rm[-1] = reward
            f = {"prompts": torch.tensor(pt, dtype=torch.int64), "responses": torch.tensor(rt, dtype=torch.int64),
                 "response_mask": torch.tensor(m), "loss_mask": torch.tensor(m),
                 "rollout_log_probs": torch.from_numpy(lp), "routed_experts": torch.from_numpy(rex),
                 "rm_scores": torch.from_numpy(rm), "input_ids": torch.tensor(np.concatenate([pt, rt])),
                 "position_ids": torch.arange(P + R), "num_turns": torch.tensor(2 + (j % 3 == 1)),
                 "metrics": {"generate_sequences": 0.1, "tool_calls": 0.0, "num_preempted": -1},
                 "extra_fields": {"min_global_steps": 1, "max_global_steps": 1, "turn_scores": []},
                 "uid": uid, "session_id": s, "index": gi, "agent_name": "tool_agent", "data_source": "gsm8k",
                 "multi_modal_inputs": {}}
            keys.append(f"{uid}_{s}_0")
            fields.append(f)
            tags.append({"status": "success", "prompt_len": P, "response_len": R, "seq_len": P + R,
                         "global_steps": 1, "min_global_steps": 1, "max_global_steps": 1})
            truth.append({"tokens": np.concatenate([pt, rt]), "P": P, "R": R, "loss_mask": m, "logp_infer": lp,
                          "reward": reward, "routes": r, "captured": captured})
    return keys, fields, tags, truth


def tq_payload_bytes(path: Path, payload: dict) -> None:
    import torch

    with tensordict_names():
        torch.save(payload, path)


def tq_dump(folder: str | Path, *, steps: int = 2, inner: int = 1, groups: int = 2, n: int = 2, seed: int = 0,
            case: str = "clean", dense: bool = False) -> tuple[Path, dict[int, list[dict]]]:
    """``{folder}/exp_proj/GBS{groups}_N{n}_in8_out8/{step}/{inner}/tq_batch.pt`` + ``meta.json`` for steps 1..steps,
    ``inner`` mini-batches per step (``parameter_sync_step``); truth per step in file order."""
    rng = np.random.default_rng(seed)
    run = Path(folder) / "exp_proj" / f"GBS{groups}_N{n}_in8_out8"
    truth: dict[int, list[dict]] = {}
    for step in range(1, steps + 1):
        truth[step] = []
        for i in range(inner):
            keys, fields, tags, t = tq_trajectories(rng, groups, n, case=case)
            for tag in tags:
                tag["global_steps"] = step
            d = run / str(step) / str(i)
            d.mkdir(parents=True, exist_ok=True)
            tq_payload_bytes(d / "tq_batch.pt", {"tensordict": _merge(fields, dense=dense), "tags": tags,
                                                 "keys": keys, "global_steps": step})
            (d / "meta.json").write_text(json.dumps({"global_steps": step, "num_trajectories": len(keys)}))
            truth[step].extend(t)
    return Path(folder), truth


# ---- skip.async_rollout -----------------------------------------------------------------------------------------
def async_dump(folder: str | Path, *, feeds: int = 3, n: int = 2, seed: int = 0, epoch: int = 0,
               uid: bool = True) -> tuple[Path, dict[int, list[dict]]]:
    """``{folder}/exp_proj/GBS0_N{n}_in8_out8/{feed}/gen_batch.dp``: one prompt's ``n`` samples each, the output of
    ``AgentLoopWorker.generate_sequences`` (meta_info ``metrics``; ``uid`` = ``uid_sample_{epoch}_{feed}`` when the
    input's non-tensor batch is copied, i.e. without reward-loop workers)."""
    rng = np.random.default_rng(seed)
    run = Path(folder) / "exp_proj" / f"GBS0_N{n}_in8_out8"
    truth = {}
    for feed in range(feeds):  # the rollouter's global_steps at feed time start at 0 in _feed_samples
        (batch, non_tensor, meta), truth[feed] = g.verl_batch(rng, n)
        u = np.empty(n, dtype=object)
        u[:] = [f"uid_sample_{epoch}_{feed}"] * n
        if uid:
            non_tensor["uid"] = u
        else:
            non_tensor.pop("uid")
        meta.pop("reward_extra_keys", None)
        d = run / str(feed)
        d.mkdir(parents=True, exist_ok=True)
        (d / "gen_batch.dp").write_bytes(g.verl_pickle((batch, non_tensor, meta)))
        (d / "meta.json").write_text(json.dumps({"global_steps": feed}))
    return Path(folder), truth
