"""vLLM's /tokenize and /detokenize on a worker over a real byte-level BPE tokenizer (a tiny checkpoint
with its tokenizer.json, a BOS post-processor added): ids as the tokenizers library gives them, chat
messages as transformers renders their template, and back to the same text."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from checkpoints import CORPUS, write_tokenizer

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.serving.worker import create_worker_app

TEXTS = [*CORPUS, "", "  two  spaces\n\tand a tab", "<|im_start|>not a chat"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world, naïve café"}]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, processors

    path = tmp_path_factory.mktemp("bpe") / "model"
    shutil.copytree(tiny_checkpoint("qwen2_tied"), path)
    write_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def app(checkpoint: Path, torch_single_thread: None) -> Iterator[Any]:
    engine = Engine(EngineConfig(model=str(checkpoint), num_threads=1, kv_capacity_tokens=4096)).start()
    try:
        yield create_worker_app(engine, "tiny")
    finally:
        engine.shutdown()


def post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            return await c.post(path, json=body)
    return asyncio.run(asyncio.wait_for(go(), 60))


def test_prompts_round_trip(app: Any, checkpoint: Path) -> None:
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    for text in TEXTS:
        got = post(app, "/tokenize", {"prompt": text, "model": "tiny"}).json()
        ids = reference.encode(text, add_special_tokens=False).ids  # as a completion of it is prefilled
        assert got == {"count": len(ids), "max_model_len": 512, "tokens": ids}, text
        assert post(app, "/detokenize", {"tokens": ids, "model": "tiny"}).json() == {"prompt": text}
        with_bos = post(app, "/tokenize", {"prompt": text, "add_special_tokens": True}).json()["tokens"]
        assert with_bos == reference.encode(text).ids == [reference.token_to_id("<s>"), *ids]  # vLLM's default
        assert post(app, "/detokenize", {"tokens": with_bos}).json()["prompt"] == "<s>" + text  # specials kept
    strs = post(app, "/tokenize", {"prompt": CORPUS[1], "return_token_strs": True}).json()["token_strs"]
    assert "".join(strs) == CORPUS[1] and len(strs) > 1  # each token's text (a split character's bytes escaped)


def test_chat_messages_as_transformers_renders_them(app: Any, checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(checkpoint)
    for cue in (True, False):
        text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=cue)
        got = post(app, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": cue}).json()
        assert got["tokens"] == hf.encode(text, add_special_tokens=False) and got["count"] == len(got["tokens"])
        assert post(app, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"] == text
    default = post(app, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    cued = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert default == hf.encode(cued, add_special_tokens=False)  # vLLM's default: the cue on, nothing added


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, None),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, None),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 100000]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, None),
])
def test_bad_requests_are_openai_errors(app: Any, path: str, body: dict[str, Any], status: int,
                                        param: str | None) -> None:
    r = post(app, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
