"""``r3lab doctor RUN``: the silent failures of routing replay, found loudly, on r3lab's own runs and imported ones.

One :class:`Report` with one :class:`Check` per line: what was checked, on how many rows, the worst offender
(step, sample, position, layer) and how to fix it. Each check comes from a bug the field hit:

* capture (FAIL): all-zero or constant routes (vLLM #33013, #49184); expert ids out of range or repeated in a
  row; route rows against tokens, ``P + R - 1`` per sample (partial and multi-turn rollouts returning only the
  last segment: verl #5344, #6054); rows for dense layers or every MoE layer shifted by one (verl #5037/#5452,
  slime #819), from the model config and per-layer statistics; MTP/speculative rows misplaced (vLLM #48622,
  SGLang #37949) where the dump says speculative decoding was on;
* the field's newest (FAIL): routes of a captured prefix padded with ``[0..k-1]`` (SkyRL #1908) and such dummy
  rows elsewhere; physical instead of logical expert ids (EPLB, vLLM #33013): ids >= E, or a layer's expert histogram
  a permutation of another's; MTP rows stored as a decoder layer's (NeMo-RL #4057, #3903; vLLM #48622). Each is a
  statistical test that fires only when its chance on real routing is below :data:`ALPHA`;
* replay (FAIL): replay that changes nothing (orphaned routers: verl #7340; MTP layers on backbone routes:
  NeMo-RL #3903); routes the trainer replayed that differ from the engine's;
* mismatch health (WARN): k3, F(2), the largest ``|Δlogp|``, IS effective sample size and TIS clip fraction per
  step, steps where k3 jumps, per-layer load imbalance (verl's ``max_vio``), layers whose engine-vs-trainer
  disagreement stands out;
* routing traces (Megatron's ``--moe-routing-trace-path``, imported as counts): dead or overloaded experts (WARN),
  expert ids >= E or layers off the model's MoE layers (FAIL), an MTP router recorded under a decoder layer's number
  (FAIL), calls the writer's top-k filter dropped (WARN);
* policy lag (WARN): stale rollouts scored with the trainer's current weights, so the reported mismatch is policy
  lag plus engine-trainer mismatch and replay (which addresses only the second) looks useless by construction
  (verl's fully-async trainer and slime's ``--keep-old-actor`` score at the rollout's weights).

Health checks warn rather than fail: a run may mean to be off-policy (staleness, a high learning rate), and the
report says so instead of stopping it. :func:`diagnose` is what the RL loop calls at the end of a run (the doctor
sits below the experiments and draws nothing; ``r3lab.viz.available`` draws what a run allows).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.errors import R3LabError, RunFormatError
from r3lab.runs import Run, load
from r3lab.vocabulary import CAPTURE_LOG_KEY, RLMetric, RunKind

__all__ = ["Check", "Report", "Thresholds", "diagnose", "health_series", "HEALTH_NAMES", "OK", "WARN", "FAIL",
           "SKIP", "facts", "LOGP_TRAIN_COLUMNS", "trace_load", "TraceLoad", "LayerLoad", "TRACE_LOAD_FILE"]

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
LOGP_TRAIN_COLUMNS = ("logp_train", "logp_old", "logp_none")  # trainer log-prob column by run kind: imported, rl, drift


@dataclass(frozen=True)
class Thresholds:
    """Where health checks start to warn; defaults sit above every committed reference run without staleness."""

    k3: float = 1e-2
    f2: float = 1e-2
    abs_dlogp: float = 5.0  # a probability ratio of e^5 ~ 150 either way
    ess: float = 0.5
    tis_clip: float = 0.05
    jump_factor: float = 10.0
    jump_window: int = 5
    vio_share: float = 0.95  # of the largest max_vio possible, E/k - 1 (all load on k experts)
    layer_factor: float = 3.0
    layer_floor: float = 0.1


@dataclass
class Check:
    """One line of the report."""

    name: str
    status: str
    what: str
    rows: int = 0
    worst: str = ""
    fix: str = ""
    detail: str = ""

    def line(self) -> str:
        s = f"{self.status.upper():4s}  {self.name:<22s} {self.what} ({self.rows} rows)"
        if self.detail:
            s += f": {self.detail}"
        if self.worst and self.status in (WARN, FAIL):
            s += f"; worst: {self.worst}"
        if self.fix and self.status in (WARN, FAIL):
            s += f"; fix: {self.fix}"
        return s


@dataclass
class Report:
    run: str
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warned(self) -> list[Check]:
        return [c for c in self.checks if c.status == WARN]

    @property
    def ok(self) -> bool:
        return not self.failed

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check {name!r} (have {[c.name for c in self.checks]})")

    def text(self) -> str:
        head = (f"r3lab doctor: {self.run}: {len(self.failed)} failed, {len(self.warned)} warnings, "
                f"{sum(c.status == OK for c in self.checks)} ok, {sum(c.status == SKIP for c in self.checks)} skipped")
        return "\n".join([head, *(c.line() for c in self.checks)])

    __str__ = text

    def _repr_markdown_(self) -> str:
        return "```\n" + self.text() + "\n```"

    def summary(self) -> dict[str, Any]:
        """The block an RL run's summary carries: counts and each check's status."""
        return {"doctor/failed": len(self.failed), "doctor/warnings": len(self.warned),
                "doctor/checks": {c.name: c.status for c in self.checks}}

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "checks": [asdict(c) for c in self.checks]}


# ---- what a run has ------------------------------------------------------------------------------------------------
@dataclass
class _Facts:
    run: Run
    engine_steps: list[int]
    trainer_steps: list[int]
    replayed_steps: list[int]
    token_steps: list[int]
    moe_ids: list[int] | None
    num_experts: int | None
    top_k: int | None
    capture: dict[str, Any]
    speculative: bool


def _layout(run: Run) -> tuple[list[int] | None, int | None, int | None]:
    """MoE layer ids, experts and top-k from the run's config (imported: its ``model``; own: its model's config)."""
    m = run.config.get("model")
    if isinstance(m, Mapping) and "moe_layer_ids" in m:
        return [int(x) for x in m["moe_layer_ids"]], int(m["num_experts"]), int(m["top_k"])
    names = [m] if isinstance(m, str) else list(run.config.get("models") or [])
    if len(names) == 1:
        try:
            from r3lab.moe_layout import MoELayout
            from r3lab.paths import model_dir

            lay = MoELayout.from_model_dir(model_dir(names[0], run.config.get("data")))
            return list(lay.moe_layer_ids), lay.num_experts, lay.top_k
        except R3LabError:
            return None, None, None
    return None, None, None


def _step_moe_ids(run: Run, step: int) -> list[int] | None:
    """MoE layer ids of the model a step ran (runs over several models name it in each step record)."""
    rec = next((r for r in run.step_records if r.get("step") == step), None)
    if not rec or not isinstance(rec.get("model"), str):
        return None
    try:
        from r3lab.moe_layout import MoELayout
        from r3lab.paths import model_dir

        return list(MoELayout.from_model_dir(model_dir(rec["model"], run.config.get("data"))).moe_layer_ids)
    except R3LabError:
        return None


def facts(run: Run) -> _Facts:
    """What a run holds that the checks and the figures need (route and token steps, layout, import log)."""
    moe, E, K = _layout(run)
    cap = run.config.get(CAPTURE_LOG_KEY) or {}
    return _Facts(run, run.route_steps("engine"), run.route_steps("trainer"), run.route_steps("replayed"),
                  run.token_steps(), moe, E, K, cap, bool(cap.get("counts", {}).get("speculative_rows") is not None
                                                           and cap.get("rows", {}).get("speculative_rows")))


def _where(**kw: Any) -> str:
    return ", ".join(f"{k} {v}" for k, v in kw.items() if v is not None)


def _cap(f: _Facts, key: str) -> tuple[int, int, dict[str, Any] | None]:
    c = f.capture
    return int(c.get("counts", {}).get(key, 0)), int(c.get("rows", {}).get(key, 0)), c.get("worst", {}).get(key)


def _fmt_worst(w: Mapping[str, Any] | None) -> str:
    if not w:
        return ""
    return _where(**{k: v for k, v in w.items() if k != "score"})


# ---- capture ------------------------------------------------------------------------------------------------------
def _constant(f: _Facts) -> Check:
    rows, bad, worst = 0, 0, ""
    for what, steps in (("engine", f.engine_steps), ("trainer", f.trainer_steps)):
        for s in steps:
            r = f.run.routes(s, what)
            rows += r.total_tokens * r.num_layers
            nz = r.values[np.repeat(r.lengths > 0, r.lengths)]
            const = metrics.constant_layers(nz)
            if const.any():
                bad += int(const.sum())
                j = int(np.argmax(const))
                worst = worst or _where(step=s, routes=what, layer=int(r.layer_ids[j]), experts=nz[0, j].tolist())
    n, m, w = _cap(f, "constant_routes")
    rows += m
    if n:
        bad += n
        worst = worst or _fmt_worst(w)
    if rows == 0:
        return Check("constant routes", SKIP, "all-zero or constant routes", detail="the run has no routes")
    return Check("constant routes", FAIL if bad else OK, "all-zero or constant routes per layer", rows, worst,
                 "the engine returned placeholder routes: enable routed-expert capture in the engine (vLLM "
                 "enable_return_routed_experts / SGLang --enable-return-routed-experts) and check the capture buffer "
                 "is filled before it is read (vLLM #33013, #49184)",
                 f"{bad} (sample, layer) blocks constant" if bad else "none constant")


def _ids(f: _Facts) -> Check:
    stored = sum(f.run.routes(s, "engine").total_tokens for s in f.engine_steps)
    n1, m1, w1 = _cap(f, "ids_out_of_range")
    n2, m2, w2 = _cap(f, "repeated_ids")
    rows = stored + max(m1, m2)
    if rows == 0:
        return Check("expert ids", SKIP, "ids in [0, E) and distinct in each row", detail="the run has no routes")
    bad = n1 + n2
    return Check("expert ids", FAIL if bad else OK, "ids in [0, E) and distinct in each top-k row", rows,
                 _fmt_worst(w1 or w2),
                 "the layer axis or expert numbering is off: ids must be the model's routed-expert numbers "
                 "(no shared experts, no EP-local ids); re-export with the engine's global ids",
                 f"{n1} rows out of range, {n2} rows with a repeated id" if bad else "all in range and distinct")


def _row_count(f: _Facts) -> Check:
    rows, bad, worst = 0, 0, ""
    for s in f.engine_steps:
        if s not in f.token_steps:
            continue
        r = f.run.routes(s, "engine")
        t = f.run.tokens([s])
        R = t.groupby("sample").size().reindex(range(len(r)), fill_value=0).to_numpy()
        n = r.lengths
        have = n > 0  # samples left out at import are counted below from the import log
        if "prompt_length" in t:
            P = t.groupby("sample")["prompt_length"].first().reindex(range(len(r))).to_numpy()
            want = P + R - 1
        else:
            want = np.where(n >= R, n, R)  # P unknown: at least R rows (P >= 1)
        off = have & (n != want)
        rows += int(have.sum())
        if off.any():
            bad += int(off.sum())
            i = int(np.argmax(np.abs(n - want) * off))
            worst = worst or _where(step=s, sample=i, rows=int(n[i]), expected=int(want[i]))
    n1, m1, w1 = _cap(f, "row_count")
    n2, m2, w2 = _cap(f, "missing_routes")
    n3, m3, w3 = _cap(f, "prefix_capture")  # shorter captures the dump marks itself (not counted in row_count)
    rows += max(m1, m2) + m3
    bad += n1 + n2
    worst = worst or _fmt_worst(w1 or w2)
    if rows == 0:
        return Check("route rows", SKIP, "route rows = P + R - 1 per sample", detail="the run has no routes")
    detail = (f"{n1 + (bad - n1 - n2)} samples with the wrong row count, {n2} without routes" if bad
              else "every sample has P + R - 1 rows")
    if n3:
        detail += (f"; {n3} samples whose capture the dump marks as a prefix (SkyRL's router_padding_mask, verl's "
                   "zero fill): their routes are left out, the trainer routes those samples itself")
    if not bad and n3:
        return Check("route rows", WARN, "route rows = P + R - 1 per sample", rows, _fmt_worst(w3),
                     "the engine captured a prefix of these samples only (an appended EOS, an observation turn or an "
                     "early stop has no engine forward, SkyRL #1908): expected, but R3 cannot replay those samples",
                     detail)
    return Check("route rows", FAIL if bad else OK, "route rows = P + R - 1 per sample", rows, worst,
                 "a partial or multi-turn rollout returned routes of its last segment only (verl #5344, #6054): "
                 "concatenate every turn's routes, prompt included, and keep routes for every sample", detail)


def _layers(f: _Facts) -> Check:
    name, what = "layer axis", "routes on MoE layers only, not shifted"
    problems, worst, rows = [], "", 0
    for wh, steps in (("engine", f.engine_steps), ("trainer", f.trainer_steps)):
        for s in steps:
            moe_ids = f.moe_ids if f.moe_ids is not None else _step_moe_ids(f.run, s)
            if moe_ids is None:
                continue
            r = f.run.routes(s, wh)
            rows += r.num_layers
            if r.layer_ids.tolist() != sorted(moe_ids):
                problems.append(f"{wh} routes of step {s} name layers {r.layer_ids.tolist()}, the model's MoE "
                                f"layers are {sorted(moe_ids)}")
                worst = worst or _where(step=s, routes=wh)
    real = {int(k): v for k, v in (f.capture.get("layer_real") or {}).items()}
    seen = {int(k): v for k, v in (f.capture.get("layer_seen") or {}).items()}
    if real and f.moe_ids is not None:
        rows += sum(seen.values())
        looks = {g for g, v in real.items() if v > seen[g] / 2}
        moe = set(f.moe_ids)
        dense_real = sorted((looks - moe) & set(seen))
        moe_dead = sorted((moe - looks) & set(seen))
        if looks and (looks == {g + 1 for g in moe} & set(seen) or looks == {g - 1 for g in moe} & set(seen)):
            problems.append(f"the routes look shifted by one layer: rows that look routed are on layers "
                            f"{sorted(looks)}, the MoE layers are {sorted(moe)}")
        elif dense_real or moe_dead:
            if dense_real:
                problems.append(f"dense layers {dense_real} carry routes")
            if moe_dead:
                problems.append(f"MoE layers {moe_dead} carry no routes")
        if dense_real or moe_dead:
            worst = worst or _where(layer=(dense_real or moe_dead)[0])
    n, m, w = _cap(f, "dense_rows")
    if n and not problems:
        problems.append(f"{n} dense-layer blocks carry routes")
        worst = worst or _fmt_worst(w)
    if rows == 0:
        return Check(name, SKIP, what, detail="no routes, or no model config to name the MoE layers")
    return Check(name, FAIL if problems else OK, what, rows, worst,
                 "map the dump's layer axis with the model's config.json: engines return rows for dense layers too "
                 "(verl #5037, vLLM #33013); an off-by-one layer index in the replay hook shifts every MoE layer "
                 "(verl #5452, slime #819)", "; ".join(problems) or "every MoE layer routed, no dense layer")


def _speculative(f: _Facts) -> Check:
    n, m, w = _cap(f, "speculative_rows")
    if not m:
        return Check("speculative rows", SKIP, "MTP/speculative rows in place",
                     detail="the dump does not say speculative decoding was on")
    return Check("speculative rows", FAIL if n else OK, "MTP/speculative rows in place (P + R - 1)", m,
                 _fmt_worst(w), "draft-token rows were kept or rejected-draft rows not dropped (vLLM #48622, SGLang "
                 "#37949): keep one row per accepted token", f"{n} samples off" if n else "in place")


# ---- the field's newest silent failures (dummy and padded rows, physical ids, MTP rows) ---------------------------
ALPHA = 1e-9
"""The largest chance that a check of this section fires on a clean run: each fires only when an upper bound on the
probability of what it saw, were the routes real routing, is below this (a union bound over everything tested)."""
HISTOGRAM_MIN_EXPERTS = 16
HISTOGRAM_MIN_MEAN = 100.0
"""The per-layer histogram test runs only with at least 16 experts and 100 picks per expert per layer on average.
Measured on independent uniform routing (2e5 layer pairs, E=16, k=2): two layers' sorted histograms coincide with
chance 1e-5 at 12.5 picks per expert and 0 at 25 and 50; the chance falls about 180x per doubling (about
mean^-(E-1)/2), so at 100 it is about 1e-12 per pair, 5e-9 over the 4950 pairs of a 100-layer model. Fewer
experts coincide far more often (E=8: 5e-6 at 50), so the test is skipped there rather than made unsound."""


def _log_tail(x: int, n: int, p: float) -> float:
    """log of an upper bound on P(Binomial(n, p) >= x): the union bound C(n, x) p^x <= (n p)^x / x!."""
    if x <= 0:
        return 0.0
    if p <= 0.0:
        return -math.inf
    return min(0.0, x * math.log(n * p) - math.lgamma(x + 1))


def _engine_routes(f: _Facts) -> list[tuple[int, Any]]:
    return [(s, f.run.routes(s, "engine")) for s in f.engine_steps]


def _dummy_split(f: _Facts) -> tuple[dict[str, Any], str]:  # noqa: C901 - one pass over the routes
    """Rows that are ``[0..k-1]`` on every MoE layer, split into trailing runs (a padded tail) and the rest.

    Returns the counts, the tests' bounds and the worst example. A row of real routing is ``[0..k-1]`` on layer l
    with a chance f_l estimated from the run (over rows that are not dummy on every layer; at least uniform's
    1/C(E, k)), so on every layer with chance p = prod f_l (layers taken independent). Each class fires only when the
    union bound on seeing that many by chance, times the number of models the run holds, is below :data:`ALPHA`.
    Steps of one model (the same layers, experts and top-k) are pooled."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    where_tail = where_mid = ""
    # an RL run of r3lab's own stores the trainer's P + R rows: each sequence ends in the arange(k) row that
    # r3lab.rollout.append_last_row adds for the last sampled token (it routes nothing that is scored), not padding
    own_pad = 1 if f.run.kind == RunKind.RL else 0
    for s, r in _engine_routes(f):
        if not r.total_tokens:
            continue
        k, E = r.top_k, r.num_experts
        g = groups.setdefault((tuple(r.layer_ids.tolist()), E, k), {"rest": [], "samples": 0, "tail": 0,
                                                                      "mid_rows": 0, "mid": 0, "E": E, "k": k})
        d = (np.sort(r.values, axis=2) == np.arange(k)).all(axis=2)  # [tokens, layers]
        every = d.all(axis=1)
        g["rest"].append(d[~every].sum(axis=0))
        g["n_rest"] = g.get("n_rest", 0) + int((~every).sum())
        tail = np.zeros(len(every), bool)
        for i in np.flatnonzero(r.lengths > 0):
            a, b = int(r.cu_seqlens[i]), int(r.cu_seqlens[i + 1]) - own_pad
            every[b:b + own_pad] = False  # r3lab's own last-row pad: neither a padded tail nor a dummy row
            g["samples"] += 1
            t = b
            while t > a and every[t - 1]:
                t -= 1
            if t < b:
                tail[t:b] = True
                g["tail"] += 1
                where_tail = where_tail or _where(step=s, sample=int(i), padded_rows=b - t, rows=b - a)
        mid = every & ~tail
        g["mid_rows"] += int((~tail).sum())
        g["mid"] += int(mid.sum())
        if mid.any() and not where_mid:
            t = int(np.flatnonzero(mid)[0])
            i = int(np.searchsorted(r.cu_seqlens, t, side="right") - 1)
            where_mid = _where(step=s, sample=i, position=t - int(r.cu_seqlens[i]))
    if not groups:
        return {}, ""
    extra = math.log(len(groups))
    out: dict[str, Any] = {"samples": 0, "tail_samples": 0, "mid_rows": 0, "mid_dummy": 0, "tail_log_bound": 0.0,
                           "mid_log_bound": 0.0, "where_tail": where_tail, "where_mid": where_mid}
    for g in groups.values():
        uniform = 1.0 / math.comb(g["E"], g["k"])
        n_rest = g.get("n_rest", 0)
        f_l = np.sum(g["rest"], axis=0) / n_rest if n_rest else np.full(len(g["rest"][0]), uniform)
        p = float(np.prod(np.maximum(f_l, uniform)))
        out["samples"] += g["samples"]
        out["tail_samples"] += g["tail"]
        out["mid_rows"] += g["mid_rows"]
        out["mid_dummy"] += g["mid"]
        out["tail_log_bound"] = min(out["tail_log_bound"], _log_tail(g["tail"], g["samples"], p) + extra)
        out["mid_log_bound"] = min(out["mid_log_bound"], _log_tail(g["mid"], g["mid_rows"], p) + extra)
    return out, ""


def _route_prefix(f: _Facts, split: dict[str, Any]) -> Check:
    name, what = "route prefix", "no sample ends in padded [0..k-1] rows (routes of a captured prefix only)"
    if not split:
        return Check(name, SKIP, what, detail="the run has no engine routes")
    n, m = split["tail_samples"], split["samples"]
    bad = n > 0 and split["tail_log_bound"] < math.log(ALPHA)
    return Check(name, FAIL if bad else OK, what, m, split["where_tail"],
                 "the engine captured routes for a prefix of the sequence and the rest was padded with [0..k-1] "
                 "(SkyRL #1908): replaying those rows sends the last tokens to experts 0..k-1. Keep the padding mask "
                 "(router_padding_mask) and drop padded rows, or re-capture with routes for every token",
                 f"{n} of {m} samples end in rows that are [0..k-1] on every layer (chance bound "
                 f"{math.exp(split['tail_log_bound']):.1e}, fires below {ALPHA:g})" if n else "no padded tails")


def _dummy_rows(f: _Facts, split: dict[str, Any]) -> Check:
    name, what = "dummy rows", "no [0..k-1]-on-every-layer rows inside a sequence"
    if not split:
        return Check(name, SKIP, what, detail="the run has no engine routes")
    n, m = split["mid_dummy"], split["mid_rows"]
    bad = n > 0 and split["mid_log_bound"] < math.log(ALPHA)
    return Check(name, FAIL if bad else OK, what, m, split["where_mid"],
                 "rows with no captured route were filled with [0..k-1] (a dummy the engine or the framework writes "
                 "where capture is missing) and read as routes: mark them missing and leave them out of replay",
                 f"{n} rows are [0..k-1] on every layer (chance bound {math.exp(split['mid_log_bound']):.1e}, fires "
                 f"below {ALPHA:g})" if n else "none")


def _expert_numbering(f: _Facts) -> Check:
    name, what = "expert numbering", "logical expert ids (not EPLB's physical slots)"
    problems, worst, rows = [], "", 0
    max_id = f.capture.get("max_id")
    if max_id is not None and f.num_experts is not None and int(max_id) >= f.num_experts:
        _, m, w = _cap(f, "ids_out_of_range")
        rows += m
        problems.append(f"ids up to {int(max_id)} >= the model's {f.num_experts} experts: physical expert slots "
                        f"(EPLB places {int(max_id) + 1 - f.num_experts}+ redundant copies)")
        worst = _fmt_worst(w)
    hists: dict[tuple[int, ...], np.ndarray] = {}  # one model's layers -> [layers, E] pooled expert counts
    for _, r in _engine_routes(f):
        if not r.total_tokens:
            continue
        c = np.stack([np.bincount(r.values[:, j].ravel().astype(np.int64), minlength=r.num_experts)
                      for j in range(r.num_layers)])
        key = tuple(r.layer_ids.tolist())
        hists[key] = hists[key] + c if key in hists and hists[key].shape == c.shape else c
    tested = ""
    for key, counts in hists.items():
        lids = list(key)
        E = counts.shape[1]
        mean = float(counts.sum(axis=1).min()) / E
        rows += int(counts[0].sum() // max(1, f.top_k or 1))  # token rows of this model
        if E >= HISTOGRAM_MIN_EXPERTS and mean >= HISTOGRAM_MIN_MEAN:
            tested = f"per-layer histograms compared ({mean:.0f} picks per expert)"
            srt = np.sort(counts, axis=1)
            spread = (counts > 0).sum(axis=1) > E // 2  # a collapsed layer's histogram is not a sample of routing
            for i in range(len(lids)):
                for j in range(i + 1, len(lids)):
                    if spread[i] and spread[j] and (srt[i] == srt[j]).all() and not (counts[i] == counts[j]).all():
                        problems.append(f"layer {lids[j]}'s expert histogram is a permutation of layer {lids[i]}'s")
                        worst = worst or _where(layer=lids[j], like_layer=lids[i])
                        break
        else:
            tested = (f"histograms not compared: {E} experts, {mean:.0f} picks per expert (the test needs "
                      f">= {HISTOGRAM_MIN_EXPERTS} and >= {HISTOGRAM_MIN_MEAN:g} to be sound)")
    if rows == 0:
        return Check(name, SKIP, what, detail="the run has no routes")
    return Check(name, FAIL if problems else OK, what, rows, worst,
                 "the engine returned physical expert ids: with EPLB (vLLM #33013) map each layer's physical slot to "
                 "its logical expert (the engine's physical-to-logical map) before the routes leave the engine",
                 "; ".join(problems) or ("ids below E" + (f"; {tested}" if tested else "")))


def _mtp_rows(f: _Facts) -> Check:
    """A layer routing identically to another on every row, in each kind of routes the run stores.

    The engine's (an MTP draft's rows stored as a decoder layer's: vLLM #48622), the trainer's own and the routes it
    replayed (an MTP router numbered like decoder layer k, fed or recording that layer's routes: NeMo-RL #4057,
    #3903); ``trainer`` and ``replayed`` are tested like ``engine``, with the union bound over every kind."""
    name, what = "MTP rows", "no layer holding another layer's routes (MTP layers numbered like decoder layers)"
    kept = int(f.capture.get("counts", {}).get("mtp_kept_apart", 0))
    rows, problems, worst = 0, [], ""
    kinds = [(k, steps) for k, steps in (("engine", f.engine_steps), ("trainer", f.trainer_steps),
                                          ("replayed", f.replayed_steps)) if steps]
    same: dict[tuple[str, int, int], list[float]] = {}  # (kind, layer pair) -> [rows, log chance they agree, ok]
    pairs = 0
    for kind, steps in kinds:
        for s in steps:
            r = f.run.routes(s, kind)
            if not r.total_tokens:
                continue
            v = np.sort(r.values, axis=2).astype(np.int64)
            code = np.zeros(v.shape[:2], np.int64)
            for c in range(v.shape[2]):
                code = code * r.num_experts + v[:, :, c]  # one integer per (row, layer): its top-k set
            rows += r.total_tokens
            L = r.num_layers
            pairs = max(pairs, L * (L - 1) // 2)
            for i in range(L):
                for j in range(i + 1, L):
                    key = (kind, int(r.layer_ids[i]), int(r.layer_ids[j]))
                    acc = same.setdefault(key, [0.0, 0.0, 1.0])
                    if acc[2] and (code[:, i] == code[:, j]).all():
                        _, ci = np.unique(code[:, i], return_counts=True)
                        fi = ci / ci.sum()
                        acc[0] += r.total_tokens
                        acc[1] += r.total_tokens * math.log(max(float((fi ** 2).sum()), 1e-300))
                    else:
                        acc[2] = 0.0
    tested = max(pairs, 1) * max(len(kinds), 1)
    for (kind, a, b), (n, logp, ok) in same.items():
        # identical on every row: chance of that for independent layers <= prod (sum_s f(s)^2)^rows (collision
        # probability of the layer's own set frequencies), times the number of pairs and kinds tested (union bound)
        if ok and n and logp + math.log(tested) < math.log(ALPHA):
            problems.append(f"layers {a} and {b} route identically on all {int(n)} rows ({kind} routes)")
            worst = worst or _where(layer=b, same_as=a, routes=kind)
    if rows == 0 and not kept:
        return Check(name, SKIP, what, detail="the run has no routes")
    detail = "; ".join(problems) or f"no layer repeats another's routes ({', '.join(k for k, _ in kinds)})"
    if kept:
        detail += f"; {kept} samples' MTP-layer rows set apart at import (not decoder layers)"
    return Check(name, FAIL if problems else OK, what, rows, worst,
                 "an MTP layer's routes were stored or replayed as a decoder layer's: Megatron numbers MTP layers "
                 "from 1, so MTP layer k shares decoder layer k's number and gets (or records) its routes (NeMo-RL "
                 "#4057, #3903; vLLM #48622). Keep MTP rows apart (r3lab sets them apart when the config declares "
                 "num_nextn_predict_layers) and replay decoder layers only (r3lab.replay.megatron_router_map finds "
                 "routers by where they sit; MegatronReplay leaves MTP routers live or replays them from mtp_routes)",
                 detail)


# ---- replay ---------------------------------------------------------------------------------------------------------
def _replay_effect(f: _Facts) -> Check:
    name, what = "replay effect", "replay changes the trainer's log-probs where routes flipped"
    flipped, changed = 0, 0
    worst = ""
    for s in f.token_steps:
        t = f.run.tokens([s])
        if not {"logp_none", "logp_r3", "flipped"} <= set(t.columns):
            return Check(name, SKIP, what, detail="needs trainer log-probs with and without replay (logp_none, "
                         "logp_r3) and route flips")
        fl = t["flipped"].to_numpy(bool)
        d = np.abs(t["logp_r3"].to_numpy() - t["logp_none"].to_numpy())
        flipped += int(fl.sum())
        changed += int((d[fl] > 0).sum())
        if fl.any() and not (d[fl] > 0).any():
            i = int(np.flatnonzero(fl)[0])
            worst = worst or _where(step=s, sample=int(t["sample"].iloc[i]), position=int(t["position"].iloc[i]))
    if not f.token_steps:
        return Check(name, SKIP, what, detail="the run has no token tables")
    if flipped == 0:
        return Check(name, SKIP, what, detail="no route-flipped tokens to test replay on")
    bad = changed == 0
    return Check(name, FAIL if bad else OK, what, flipped, worst,
                 "the replayed routes never reach the routers (orphaned routers: verl #7340; MTP layers on backbone "
                 "routes: NeMo-RL #3903): check every router of the model is patched and its replay buffer is set",
                 f"{changed} of {flipped} route-flipped tokens changed under replay")


def _replayed_routes(f: _Facts) -> Check:
    name, what = "replayed routes", "routes the trainer used under replay = the engine's"
    if not f.replayed_steps:
        return Check(name, SKIP, what, detail="the run stores no routes of the trainer under replay ('replayed')")
    rows, bad, worst = 0, 0, ""
    for s in f.replayed_steps:
        if s not in f.engine_steps:
            continue
        e, r = f.run.routes(s, "engine"), f.run.routes(s, "replayed")
        if e.values.shape != r.values.shape or not np.array_equal(e.layer_ids, r.layer_ids):
            bad += 1
            worst = worst or _where(step=s, detail=f"shapes {e!r} vs {r!r}")
            continue
        d = metrics.set_differs(e.values, r.values)
        rows += d.size
        if d.any():
            bad += int(d.sum())
            t, j = np.argwhere(d)[0]
            i = int(np.searchsorted(e.cu_seqlens, t, side="right") - 1)
            worst = worst or _where(step=s, sample=i, position=int(t - e.cu_seqlens[i]), layer=int(e.layer_ids[j]))
    return Check(name, FAIL if bad else OK, what, rows, worst,
                 "the trainer did not route with the replayed ids: check the rows are sliced to each rank's tokens in "
                 "the same order (CP/SP/packing) and that no router falls back to its own top-k",
                 f"{bad} (token, layer) rows differ" if bad else "identical")


# ---- mismatch health -----------------------------------------------------------------------------------------------
HEALTH_NAMES = _HEALTH = {"k3_kl": "k3", "extreme_frac_tau2": "F(2)", "logprob_abs_diff_max": "max |dlogp|",
           "is_eff_sample_size": "IS ESS", "tis_clipfrac": "TIS clip"}


def _health_series(f: _Facts) -> tuple[list[int], dict[str, np.ndarray], int, dict[int, str]]:
    """Per step: the mismatch metrics (from step records, else from token tables), tokens, worst token per step."""
    recs = [r for r in f.run.step_records if RLMetric.K3_KL in r]
    worst: dict[int, str] = {}
    if recs:
        steps = [int(r["step"]) for r in recs]
        ser = {k: np.array([np.nan if r.get(f"mismatch/{k}") is None else r[f"mismatch/{k}"] for r in recs], float)
               for k in _HEALTH}
        n = int(sum(r.get(RLMetric.MISMATCH_TOKENS) or 0 for r in recs))
        for s in f.token_steps:
            w = _worst_token(f.run.tokens([s]))
            if w:
                worst[s] = w
        return steps, ser, n, worst
    steps, rows, n = [], [], 0
    for s in f.token_steps:
        t = f.run.tokens([s])
        col = next((c for c in LOGP_TRAIN_COLUMNS if c in t), None)
        if col is None or "logp_infer" not in t:
            continue
        m = t["loss_mask"].to_numpy() > 0 if "loss_mask" in t else np.ones(len(t), bool)
        if not m.any():
            continue
        mm = metrics.mismatch_metrics(t[col].to_numpy()[m], t["logp_infer"].to_numpy()[m])
        steps.append(s)
        rows.append(mm)
        n += mm["tokens"]
        worst[s] = _worst_token(t) or ""
    return steps, {k: np.array([r[k] for r in rows], float) for k in _HEALTH}, n, worst


def _worst_token(t: Any) -> str | None:
    col = next((c for c in LOGP_TRAIN_COLUMNS if c in t), None)
    if col is None or "logp_infer" not in t or not len(t):
        return None
    d = np.abs(t[col].to_numpy() - t["logp_infer"].to_numpy())
    if "loss_mask" in t:
        d = np.where(t["loss_mask"].to_numpy() > 0, d, -1)
    i = int(np.nanargmax(d))
    return _where(sample=int(t["sample"].iloc[i]), position=int(t["position"].iloc[i]), dlogp=f"{d[i]:.3g}")


def _health(f: _Facts, th: Thresholds) -> list[Check]:
    steps, ser, n, worst_tok = _health_series(f)
    names = ["k3", "F(2)", "max |dlogp|", "IS ESS", "TIS clip", "k3 jumps"]
    if not steps:
        return [Check(nm, SKIP, "mismatch health per step", detail="needs engine and trainer log-probs")
                for nm in names]
    out = []
    fix = ("engine and trainer disagree: replay the engine's routes (R3), match the engine's and trainer's dtypes and "
           "kernels, or correct with TIS/MIS")
    rules = (("k3_kl", "k3", lambda v: v > th.k3, np.nanargmax, f"> {th.k3:g}"),
             ("extreme_frac_tau2", "F(2)", lambda v: v > th.f2, np.nanargmax, f"> {th.f2:g}"),
             ("logprob_abs_diff_max", "max |dlogp|", lambda v: v > th.abs_dlogp, np.nanargmax, f"> {th.abs_dlogp:g}"),
             ("is_eff_sample_size", "IS ESS", lambda v: v < th.ess, np.nanargmin, f"< {th.ess:g}"),
             ("tis_clipfrac", "TIS clip", lambda v: v > th.tis_clip, np.nanargmax, f"> {th.tis_clip:g}"))
    for key, nm, bad, arg, rule in rules:
        v = ser[key]
        if np.isnan(v).all():
            out.append(Check(nm, SKIP, f"{nm} per step", detail="not recorded"))
            continue
        flag = np.array([bad(x) if np.isfinite(x) else False for x in v])
        i = int(arg(v))
        out.append(Check(nm, WARN if flag.any() else OK, f"{nm} per step over {len(steps)} steps", n,
                         _where(step=steps[i], value=f"{v[i]:.3g}") + (f", {worst_tok[steps[i]]}"
                                                                        if worst_tok.get(steps[i]) else ""),
                         fix, f"{int(flag.sum())} steps {rule}; worst {v[i]:.3g}" if flag.any()
                         else f"worst {v[i]:.3g} (warns {rule})"))
    k3 = ser["k3_kl"]
    jumps = metrics.jump_steps(k3, window=th.jump_window, factor=th.jump_factor, floor=th.k3)
    js = [steps[i] for i in np.flatnonzero(jumps)]
    out.append(Check("k3 jumps", WARN if js else OK, f"k3 rising {th.jump_factor:g}x over the last "
                     f"{th.jump_window} steps, above {th.k3:g}", len(steps),
                     _where(step=js[0], k3=f"{k3[steps.index(js[0])]:.3g}") if js else "",
                     "a jump in mismatch precedes collapse (R3 and TIS reports): look at what changed at that step "
                     "(learning rate, staleness, a new weight sync) and stop or correct before it compounds",
                     f"jumps at steps {js[:8]}" if js else "no jump"))
    return out


def _imbalance(f: _Facts, th: Thresholds) -> Check:
    name, what = "max_vio", "per-layer expert load imbalance (verl rollout/moe/max_vio)"
    worst_v, worst, rows = -math.inf, "", 0
    E = K = None
    for s in f.engine_steps:
        r = f.run.routes(s, "engine")
        if r.total_tokens == 0:
            continue
        E, K = r.num_experts, r.top_k
        vio = metrics.max_violation(metrics.expert_load(r.values, r.num_experts))
        rows += r.total_tokens * r.num_layers
        j = int(np.argmax(vio))
        if vio[j] > worst_v:
            worst_v, worst = float(vio[j]), _where(step=s, layer=int(r.layer_ids[j]), max_vio=f"{vio[j]:.2f}")
    if rows == 0:
        vals = [(int(r["step"]), r[RLMetric.ENGINE_MAX_VIO]) for r in f.run.step_records
                if r.get(RLMetric.ENGINE_MAX_VIO) is not None]
        if not vals or f.num_experts is None:
            return Check(name, SKIP, what, detail="the run has no engine routes")
        E, K = f.num_experts, f.top_k
        s, worst_v = max(vals, key=lambda x: x[1])
        rows, worst = len(vals), _where(step=s, max_vio=f"{worst_v:.2f}")
    limit = th.vio_share * (E / K - 1)
    return Check(name, WARN if worst_v > limit else OK, what, rows, worst,
                 "experts collapse onto a few: check the router's load-balancing loss / bias update and that the "
                 "captured layer is the one you think", f"worst {worst_v:.2f} (warns above {limit:.2f} = "
                 f"{th.vio_share:g} x (E/k - 1))")


def _layer_outliers(f: _Facts, th: Thresholds) -> Check:
    name, what = "layer disagreement", "layers whose engine-vs-trainer disagreement stands out"
    acc: dict[int, list[float]] = {}
    rows = 0
    for s in sorted(set(f.engine_steps) & set(f.trainer_steps)):
        e, t = f.run.routes(s, "engine"), f.run.routes(s, "trainer")
        if e.values.shape != t.values.shape or not e.total_tokens:
            continue
        rate = metrics.route_change_rate(e.values, t.values)
        rows += e.total_tokens * e.num_layers
        for g, v in zip(e.layer_ids, rate, strict=True):
            acc.setdefault(int(g), []).append(float(v))
    if not acc:
        for r in f.run.step_records:
            per = r.get(RLMetric.ENGINE_TRAINER_DISAGREEMENT_PER_LAYER)
            if isinstance(per, Mapping):
                rows += len(per)
                for g, v in per.items():
                    acc.setdefault(int(g), []).append(float(v))
    if not acc:
        return Check(name, SKIP, what, detail="this run has no trainer routes")
    lids = sorted(acc)
    mean = np.array([np.mean(acc[g]) for g in lids])
    out = metrics.outlier_layers(mean, factor=th.layer_factor, floor=th.layer_floor)
    j = int(np.argmax(mean))
    return Check(name, WARN if out.any() else OK, what, rows,
                 _where(layer=lids[j], disagreement=f"{mean[j]:.3f}", median=f"{np.median(mean):.3f}"),
                 "one layer's router disagrees far more than the rest: check that layer's replay hook, its dtype "
                 "(router in fp32?) and whether its index is off by one",
                 f"layers {[lids[i] for i in np.flatnonzero(out)]} stand out" if out.any()
                 else f"largest {mean[j]:.3f} at layer {lids[j]} (median {np.median(mean):.3f})")


def _policy_lag(f: _Facts) -> Check:
    name, what = "policy lag", "stale rollouts scored at the weights that sampled them"
    cfg = f.run.config
    if f.run.kind not in (RunKind.RL, RunKind.IMPORTED) or "staleness" not in cfg:  # imported: slime's weight_versions
        return Check(name, SKIP, what, detail="the run does not say how stale its rollouts were")
    stale, old = int(cfg["staleness"]), cfg.get("old_logprobs", "current")
    steps = [r for r in f.run.step_records if int(r.get("step", 0)) >= stale]
    if stale == 0:
        return Check(name, OK, what, len(steps), detail="on-policy rollouts (staleness 0): no lag to separate")

    def mean(key: str) -> float | None:
        v = [r[key] for r in steps if r.get(key) is not None]
        return float(np.mean(v)) if v else None

    if old == "behaviour":
        lag, match = mean(RLMetric.K3_POLICY_LAG), mean(RLMetric.K3_KL)
        parts = (f": policy lag k3 {lag:.2e}, engine-trainer k3 at matched weights {match:.2e}"
                 if lag is not None and match is not None else "")
        return Check(name, OK, what, len(steps), detail=f"staleness {stale}, old log-probs at the behaviour "
                     f"weights{parts}")
    total = mean(RLMetric.K3_KL)
    return Check(name, WARN, what, len(steps), f"staleness {stale}, mean k3 {total:.2e}" if total is not None else
                 f"staleness {stale}", "score at the rollout's weights (--old-logprobs behaviour, as verl's "
                 "fully-async trainer and slime's --keep-old-actor do): then the engine-trainer mismatch that replay "
                 "addresses and the policy lag are measured apart",
                 f"staleness {stale} with old log-probs from the current weights: the k3 reported is policy lag plus "
                 "engine-trainer mismatch, and replay can cut only the second")


def _saved_policy(f: _Facts) -> Check:
    """The policies an RL run saved (``--save-every``; format ``r3lab-policy`` of :mod:`r3lab.runs.policy`): each
    readable, of the version this r3lab reads, at the steps the config says, of the run's model and seed, its state
    file the bytes its digest names. A resumed run (``--init-from``) starts from one of these, so a corrupt or
    foreign save would silently branch an arm from the wrong policy."""
    from r3lab.runs.policy import policy_problems

    name, what = "saved policy", "the policies the run saved (format, steps, model, state digest)"
    cfg = f.run.config
    if f.run.kind != RunKind.RL or f.run.path is None:
        return Check(name, SKIP, what, detail="not an RL run of r3lab's")
    found, problems = policy_problems(f.run.path, cfg)
    if not found and not cfg.get("save_every"):
        return Check(name, SKIP, what, detail="the run saved no policy (--save-every 0)")
    if problems:
        return Check(name, FAIL, what, found, "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)"
                     if len(problems) > 3 else ""), "save again; a resumed run reads only a save that checks out",
                     "a policy a resumed run would start from is not what its run saved")
    if cfg.get("save_every") and not found:
        return Check(name, WARN, what, 0, f"save_every {cfg['save_every']} but no save in the run folder")
    return Check(name, OK, what, found, detail=f"{found} saves of format {cfg.get('save_format', 'r3lab-policy-1')}")


# ---- Megatron routing traces (expert-load runs: counts per step, layer and rank, no tokens) -------------------------
TRACE_LOAD_FILE = "expert_load.npz"  # r3lab.importers.megatron_trace writes it; trace_load reads it
TRACE_BLOCKS = ("decoder", "mtp")  # the trace's "block", stored as its index
TRACE_NOTE = ("Megatron routing trace: expert counts per step, block, layer and rank only. The trace has no token ids "
              "and no sample boundaries, so per-sample replay comparison (engine vs trainer routes per token, "
              "log-prob drift) needs samples the trace does not have. Padding rows are counted: the trace cannot "
              "tell them apart.")
_TRACE_ARRAYS = ("step", "block", "mtp_idx", "layer", "rank", "calls", "distinct_calls", "rows", "weighted_rows",
                 "counts", "weight_sums", "global_layer")


@dataclass(frozen=True)
class LayerLoad:
    """Expert picks per layer (``counts`` ``[layers, E]``) where a run has counts and no routes (a routing trace):
    what the expert-load figures draw in place of routes."""

    layer_ids: np.ndarray
    counts: np.ndarray
    top_k: int | None = None
    label: str = ""

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[1])

    @property
    def num_layers(self) -> int:
        return int(self.counts.shape[0])

    def load(self) -> np.ndarray:
        """``[L, E]`` share of each layer's picks per expert (as :func:`r3lab.metrics.expert_load` of routes)."""
        tot = self.counts.sum(axis=1, keepdims=True)
        return self.counts / np.maximum(tot, 1)


@dataclass(frozen=True)
class TraceLoad:
    """An imported routing trace's counts, one entry per ``(step, block, mtp_idx, layer, rank)`` (arrays of one
    length; ``counts`` and ``weight_sums`` ``[entries, E]``, ``weight_sums`` NaN where the record had no logits)."""

    arrays: Mapping[str, np.ndarray]
    num_experts: int | None  # the model's (config), else None
    top_k: int | None
    moe_ids: list[int] | None = None  # the model's MoE layers (config), else None

    def __getitem__(self, key: str) -> np.ndarray:
        return self.arrays[key]

    @property
    def steps(self) -> list[int]:
        return sorted(set(self["step"].tolist()))

    def per_layer(self, steps: list[int] | None = None, block: str = "decoder", mtp_idx: int | None = None
                  ) -> LayerLoad:
        """Picks per layer pooled over ranks (and ``steps``, default all): decoder layers by their global id, MTP
        layers (``block="mtp"``) by ``mtp_idx`` and inner layer (``mtp_idx * 1000 + layer``)."""
        m = self["block"] == TRACE_BLOCKS.index(block)
        if steps is not None:
            m &= np.isin(self["step"], steps)
        if mtp_idx is not None:
            m &= self["mtp_idx"] == mtp_idx
        ids = self["global_layer"] if block == "decoder" else self["mtp_idx"] * 1000 + self["layer"]
        lids = np.unique(ids[m])
        counts = np.stack([self["counts"][m & (ids == g)].sum(axis=0) for g in lids]) if len(lids) else \
            np.zeros((0, self["counts"].shape[1]), np.int64)
        return LayerLoad(lids, counts, self.top_k, label=f"{block} trace")


def trace_load(run: Run) -> TraceLoad | None:
    """The routing-trace counts of an imported Megatron trace run, None for any other run."""
    p = run.path / TRACE_LOAD_FILE
    if not p.is_file():
        return None
    with np.load(p, allow_pickle=False) as z:
        missing = [k for k in _TRACE_ARRAYS if k not in z.files]
        if missing:
            raise RunFormatError(f"{str(p)!r} lacks {missing}: not an r3lab routing-trace table")
        arrays = {k: z[k] for k in _TRACE_ARRAYS}
    moe, E, K = _layout(run)
    return TraceLoad(arrays, E, K, moe)


def _trace_modal(t: TraceLoad, block: int) -> dict[tuple[int, int], int]:
    """Per ``(step, rank)``: the most common number of distinct calls of a ``block`` layer (the microbatches)."""
    out: dict[tuple[int, int], int] = {}
    m = t["block"] == block
    st, rk, dc = t["step"][m], t["rank"][m], t["distinct_calls"][m]
    for s, r in set(zip(st.tolist(), rk.tolist(), strict=True)):
        v = dc[(st == s) & (rk == r)]
        vals, cnt = np.unique(v, return_counts=True)
        out[(s, r)] = int(vals[np.argmax(cnt)])
    return out


def _trace_experts(t: TraceLoad, th: Thresholds) -> Check:
    """Dead experts (never picked where chance says they would be) and overloaded ones (max_vio), per decoder layer
    pooled over steps and ranks."""
    name, what = "trace expert load", "dead or overloaded experts per layer (routing trace)"
    ll = t.per_layer()
    E = t.num_experts or ll.num_experts
    K = t.top_k or None
    if ll.num_layers == 0 or not ll.counts.sum():
        return Check(name, SKIP, what, detail="the trace has no decoder router rows")
    c = ll.counts[:, :E]
    picks = c.sum(axis=1)
    rows = int(picks.sum() // (K or 1))
    k = K or max(1, int(round(picks.sum() / max(1, int(t["rows"][t["block"] == 0].sum())))))
    problems, worst = [], ""
    for i, g in enumerate(ll.layer_ids):
        dead = np.flatnonzero(c[i] == 0)
        n_rows = picks[i] / k
        # an expert left out of all n top-k rows by uniform routing: (1 - k/E)^n; union over experts and layers
        if len(dead) and E > k and n_rows * math.log1p(-k / E) + math.log(E * ll.num_layers) < math.log(ALPHA):
            problems.append(f"layer {int(g)}: experts {dead.tolist()[:8]} never picked in {int(n_rows)} rows")
            worst = worst or _where(layer=int(g), dead_experts=len(dead))
    vio = metrics.max_violation(c / np.maximum(picks[:, None], 1))
    limit = th.vio_share * (E / k - 1)
    j = int(np.argmax(vio))
    if vio[j] > limit:
        problems.append(f"layer {int(ll.layer_ids[j])}: max_vio {vio[j]:.2f} (warns above {limit:.2f})")
        worst = worst or _where(layer=int(ll.layer_ids[j]), max_vio=f"{vio[j]:.2f}")
    return Check(name, WARN if problems else OK, what, rows, worst,
                 "experts that never fire or take most of the load: check the router's load-balancing loss / bias "
                 "update; padding rows are counted (the trace cannot tell them apart), so a long padded batch can "
                 "pile onto a few experts", "; ".join(problems) or
                 f"max_vio {vio.min():.2f} - {vio.max():.2f} over {ll.num_layers} layers (padding rows included)")


def _trace_ids(t: TraceLoad) -> Check:
    """Expert ids within the model's experts, and decoder layers on the model's MoE layers (ids shifted by one, a
    1-based numbering read as 0-based, or the reverse)."""
    name, what = "trace layer ids", "expert ids in [0, E) and layers on the model's MoE layers (routing trace)"
    E, moe = t.num_experts, t.moe_ids
    problems, worst = [], ""
    dec = t["block"] == 0
    rows = int(t["rows"].sum())
    if E is not None:
        over = t["counts"][:, E:].sum(axis=1) if t["counts"].shape[1] > E else np.zeros(len(dec), np.int64)
        for blk in (0, 1):
            m = (t["block"] == blk) & (over > 0)
            if m.any():
                lids = sorted(set((t["global_layer"] if blk == 0 else t["layer"])[m].tolist()))
                never0 = bool((t["counts"][m][:, 0] == 0).all())
                problems.append(f"{TRACE_BLOCKS[blk]} layers {lids[:8]}: expert ids up to {t['counts'].shape[1] - 1} "
                                f">= the model's {E}" + (", and expert 0 never picked: ids look shifted by one"
                                                        if never0 else ""))
                worst = worst or _where(block=TRACE_BLOCKS[blk], layer=lids[0])
    if moe is not None and dec.any():
        g = sorted(set(t["global_layer"][dec].tolist()))
        off = [x for x in g if x not in moe]
        if off:
            shifted = [x - 1 for x in g]
            hint = " (one less fits: 1-based numbers read as 0-based)" if all(x in moe for x in shifted) else (
                " (one more fits: 0-based numbers read as 1-based)" if all(x + 1 in moe for x in g) else "")
            problems.append(f"decoder layers {off[:8]} are not the model's MoE layers {moe[:8]}...{hint}")
            worst = worst or _where(layer=off[0])
    if E is None and moe is None:
        return Check(name, SKIP, what, rows, detail="no model config recorded (import with --config)")
    return Check(name, FAIL if problems else OK, what, rows, worst,
                 "re-import with the model's --config and the trace's numbering (--layer-numbering, "
                 "--pipeline-parallel); ids >= E are physical slots or a shifted numbering in the writer",
                 "; ".join(problems) or "ids below E, layers on MoE layers")


def _trace_mtp(t: TraceLoad) -> Check:
    """A decoder layer with more distinct calls per step and rank than the other layers: another router (an MTP
    head, numbered like decoder layer k by ``record_indices``) written under its number."""
    name, what = "trace MTP numbering", "no MTP router recorded under a decoder layer's number (routing trace)"
    modal = _trace_modal(t, 0)
    dec = t["block"] == 0
    if not dec.any():
        return Check(name, SKIP, what, detail="the trace has no decoder records")
    extra = [(int(s), int(r), int(g), int(c)) for s, r, g, c in zip(
        t["step"][dec], t["rank"][dec], t["layer"][dec], t["distinct_calls"][dec], strict=True)
        if c > modal[(int(s), int(r))]]
    n_mtp = int((t["block"] == 1).sum())
    rows = int(t["rows"][dec].sum())
    detail = f"{n_mtp} MTP entries kept apart (block mtp)" if n_mtp else "no MTP records"
    if not extra:
        return Check(name, OK, what, rows, detail=f"every decoder layer called alike per step and rank; {detail}")
    s, r, g, c = extra[0]
    layers = sorted({e[2] for e in extra})
    return Check(name, FAIL, what, rows, _where(step=s, rank=r, layer=g, calls=c, others=modal[(s, r)]),
                 "an MTP router wrote its records under a decoder layer's number (Megatron numbers MTP layers from 1; "
                 "record_indices writes every layer as block \"decoder\"): trace with the forward hooks, which keep "
                 "MTP apart (block \"mtp\", mtp_idx), or drop the MTP routers' RouterReplay instances from layer_ids",
                 f"decoder layers {layers[:8]} have more distinct router calls than the other layers in "
                 f"{len(extra)} (step, rank) entries")


def _trace_dropped(t: TraceLoad) -> Check:
    """Layers with fewer calls than the other layers of their step and rank, or missing from a step the rank traced
    them in elsewhere: records the writer skipped (its top-k filter drops a call with rows of other than top-k
    experts, e.g. under token dropping)."""
    name, what = "trace dropped records", "every layer's router calls recorded (the writer's top-k filter)"
    out, missing = [], []
    for blk in (0, 1):
        m = t["block"] == blk
        if not m.any():
            continue
        modal = _trace_modal(t, blk)
        st, rk, lay, mi, dc = (t["step"][m], t["rank"][m], t["layer"][m], t["mtp_idx"][m], t["distinct_calls"][m])
        for s, r, g, c in zip(st.tolist(), rk.tolist(), lay.tolist(), dc.tolist(), strict=True):
            if c < modal[(s, r)]:
                out.append((s, r, TRACE_BLOCKS[blk], g, c, modal[(s, r)]))
        for r in set(rk.tolist()):
            have = {(int(a), int(b)) for a, b in zip(lay[rk == r], mi[rk == r], strict=True)}
            for s in set(st[rk == r].tolist()):
                sel = (rk == r) & (st == s)
                got = {(int(a), int(b)) for a, b in zip(lay[sel], mi[sel], strict=True)}
                for g, _ in sorted(have - got):
                    missing.append((s, r, TRACE_BLOCKS[blk], g, 0, modal[(s, r)]))
    rows = int(t["calls"].sum())
    if not out and not missing:
        return Check(name, OK, what, rows, detail="every layer has the same number of calls per step and rank")
    first = (out + missing)[0]
    parts = []
    if out:
        parts.append(f"{len(out)} layer entries with fewer calls than their step and rank's other layers")
    if missing:
        parts.append(f"{len(missing)} layers missing from a step their rank traced them in elsewhere")
    return Check(name, WARN, what, rows, _where(step=first[0], rank=first[1], block=first[2], layer=first[3],
                                                calls=first[4], others=first[5]),
                 "Megatron's RouterTracer skips a call whose routing map has other than num_tokens x topk entries "
                 "(token dropping by capacity factor, or a router changed to return fewer experts): those layers' "
                 "load is undercounted; trace without token dropping to count every call", "; ".join(parts))


def _trace_checks(f: _Facts, th: Thresholds) -> list[Check]:
    """The checks a routing trace allows (none for other runs)."""
    t = trace_load(f.run)
    if t is None:
        return []
    return [_trace_experts(t, th), _trace_ids(t), _trace_mtp(t), _trace_dropped(t)]


def diagnose(run: Run | str | os.PathLike, *, thresholds: Thresholds | None = None) -> Report:
    """Every check on one run (own or imported); read the result with ``report.ok`` / ``print(report)``."""
    r = run if isinstance(run, Run) else load(run)
    th = thresholds or Thresholds()
    f = facts(r)
    split, _ = _dummy_split(f)
    checks = [_constant(f), _ids(f), _row_count(f), _layers(f), _speculative(f), _route_prefix(f, split),
              _dummy_rows(f, split), _expert_numbering(f), _mtp_rows(f), _replay_effect(f), _replayed_routes(f),
              *_health(f, th), _imbalance(f, th), _layer_outliers(f, th), _policy_lag(f), _saved_policy(f),
              *_trace_checks(f, th)]
    return Report(str(r.path), checks)


def health_series(run: Run | str | os.PathLike) -> tuple[list[int], dict[str, np.ndarray], int]:
    """The mismatch health the doctor checks, per step: ``(steps, {metric: values}, tokens)`` (metrics: k3_kl,
    extreme_frac_tau2, logprob_abs_diff_max, is_eff_sample_size, tis_clipfrac)."""
    r = run if isinstance(run, Run) else load(run)
    steps, ser, n, _ = _health_series(facts(r))
    return steps, ser, n
