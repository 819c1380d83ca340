"""Progress and logging from Python: loading a sharded Hugging Face directory reports its bytes
(tqdm bars by default, or a callback), a warning raised in the engine reaches a `logging` handler
of the logger "roundpipe", RP_LOG_LEVEL sets the level of the library and of that logger, and the
timing record names CPU devices as CPU (as bench/plot_trace.py labels them).

The sharded checkpoints are written here with a small safetensors writer, from tensors whose
byte count the test computes itself (numel x 4 for float32).
"""

import json
import logging
import os
import struct
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import roundpipe  # noqa: E402

DEVICES = ("cpu", 2)
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "initializer_range": 0.02, "dtype": "float32",
}


def write_safetensors(path, tensors):
    """A safetensors file of float32 tensors: 8-byte header length, JSON header, raw data."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.detach().to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.writelines(blobs)


def hf_tensors():
    """{Hugging Face name: tensor} of a tiny Llama with seeded random weights."""
    with roundpipe.RoundPipe(LLAMA_CONFIG, devices=DEVICES, seed=3) as model:
        return {model.hf_parameter_name(name): t for name, t in model.state_dict().items()}


def write_checkpoint(directory, tensors, shards):
    """config.json and the tensors, in `shards` files with an index when shards > 1."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(LLAMA_CONFIG, f)
    if shards == 1:
        write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
        return str(directory)
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        file = "model-%05d-of-%05d.safetensors" % (s + 1, shards)
        part = {n: tensors[n] for n in names[s::shards]}
        write_safetensors(os.path.join(directory, file), part)
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(directory)


@pytest.fixture
def restore_progress():
    yield
    roundpipe.set_progress_callback(None)


def test_loading_a_sharded_directory_reports_every_byte_once_ending_at_the_total(
        tmp_path, restore_progress):
    tensors = hf_tensors()
    total = sum(t.numel() * 4 for t in tensors.values())
    directory = write_checkpoint(tmp_path / "sharded", tensors, shards=3)
    calls = []
    roundpipe.set_progress_callback(lambda what, done, total: calls.append((what, done, total)))
    with roundpipe.RoundPipe(directory, devices=DEVICES) as model:
        loaded = {model.hf_parameter_name(n): t for n, t in model.state_dict().items()}
        assert [c for c in calls if c[0] != "load " + directory] == []
        assert {c[2] for c in calls} == {total}
        dones = [c[1] for c in calls]
        assert dones[0] == 0 and dones[-1] == total and dones == sorted(dones)
        assert dones.count(total) == 1  # the end is reported once, last
        assert len(calls) >= 3  # progress moves during the load, not only at its ends
        del calls[:]
        model.save_pretrained(str(tmp_path / "out"))  # same layout: 3 shards
        assert calls[0] == ("save " + str(tmp_path / "out"), 0, total)
        assert calls[-1] == ("save " + str(tmp_path / "out"), total, total)
    for name, t in tensors.items():
        torch.testing.assert_close(loaded[name], t, rtol=0, atol=0)


def test_loading_a_sharded_directory_shows_a_tqdm_progress_bar(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    directory = write_checkpoint(tmp_path / "sharded", hf_tensors(), shards=3)
    capsys.readouterr()
    with roundpipe.RoundPipe(directory, devices=DEVICES):
        pass
    err = capsys.readouterr().err
    assert "Loading sharded" in err and "100%" in err, err


def test_a_failed_callback_is_ignored_and_the_load_succeeds(tmp_path, restore_progress):
    directory = write_checkpoint(tmp_path / "single", hf_tensors(), shards=1)

    def broken(what, done, total):
        raise RuntimeError("progress display failed")

    roundpipe.set_progress_callback(broken)
    with roundpipe.RoundPipe(directory, devices=DEVICES) as model:
        assert model.num_layers == 5  # embedding, 2 decoder layers, norm, head
    with pytest.raises(TypeError):
        roundpipe.set_progress_callback(42)


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_an_engine_warning_reaches_a_logging_handler(tmp_path):
    tensors = hf_tensors()
    tensors["model.layers.0.extra.weight"] = torch.ones(3)  # not a parameter of the model
    directory = write_checkpoint(tmp_path / "extra", tensors, shards=1)
    handler = ListHandler()
    logger = logging.getLogger("roundpipe")
    logger.addHandler(handler)
    try:
        with roundpipe.RoundPipe(directory, devices=DEVICES):
            pass
    finally:
        logger.removeHandler(handler)
    warnings = [r for r in handler.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in handler.records]
    assert warnings[0].name == "roundpipe"
    message = warnings[0].getMessage()
    assert "not used by the model" in message and "model.layers.0.extra.weight" in message


def run_python(code, tmp_path, level):
    """Runs `code` in a fresh interpreter (RP_LOG_LEVEL is read once per process) with
    RP_LOG_LEVEL=level, or without RP_LOG_LEVEL when level is None; returns its stdout."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "RP_LOG_LEVEL"}
    if level is not None:
        env["RP_LOG_LEVEL"] = level
    env["ROUNDPIPE_LIBRARY"] = roundpipe.library_path()
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.abspath(roundpipe.__path__[0])), here]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


# Builds MODEL with a handler on the logger "roundpipe"; prints the logger's level and every
# record the handler received.
LOG_SCRIPT = """
    import logging, roundpipe
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)
    logging.getLogger("roundpipe").addHandler(Keep())
    SETUP
    with roundpipe.RoundPipe(MODEL, devices=("cpu", 1), name="level-test"):
        pass
    print("LEVEL", logging.getLevelName(logging.getLogger("roundpipe").level))
    for r in records:
        print("RECORD", r.name, r.levelname, r.getMessage())
"""
LINEAR = '[{"type": "linear", "in": 2, "out": 2}]'


def log_script(model=LINEAR, setup="pass"):
    return LOG_SCRIPT.replace("MODEL", model).replace("SETUP", setup)


def test_rp_log_level_info_sets_the_logger_level_and_info_messages_arrive(tmp_path):
    out = run_python(log_script(), tmp_path, "info")
    assert "LEVEL INFO" in out
    # The engine logs each new model's layout at info level.
    assert "RECORD roundpipe INFO level-test: 1 layers" in out, out


def test_without_rp_log_level_the_logger_level_decides(tmp_path):
    out = run_python(log_script(), tmp_path, None)
    # The logger is left NOTSET: the root logger's WARNING filters the info message.
    assert "LEVEL NOTSET" in out and "RECORD" not in out, out
    out = run_python(log_script(setup="logging.getLogger('roundpipe').setLevel(logging.INFO)"),
                     tmp_path, None)
    assert "RECORD roundpipe INFO level-test: 1 layers" in out, out


def test_rp_log_level_error_silences_engine_warnings(tmp_path):
    tensors = hf_tensors()
    tensors["model.extra.weight"] = torch.ones(2)
    directory = write_checkpoint(tmp_path / "extra", tensors, shards=1)
    out = run_python(log_script(model=repr(directory)), tmp_path, "error")
    assert "LEVEL ERROR" in out and "RECORD" not in out, out
    out = run_python(log_script(model=repr(directory)), tmp_path, "warn")
    assert "RECORD roundpipe WARNING" in out and "model.extra.weight" in out, out


# ---------------------------------------------------------------------------------------------
# The timing record names its devices
# ---------------------------------------------------------------------------------------------


def test_trace_names_cpu_worker_devices_and_plot_trace_labels_them_cpu(tmp_path):
    with roundpipe.RoundPipe([{"type": "linear", "in": 4, "out": 4}, {"type": "relu"},
                              {"type": "linear", "in": 4, "out": 2}], devices=DEVICES) as m:
        m.forward_backward((torch.randn(6, 4),), label=torch.randn(6, 2), loss_fn="mse")
        trace = m.trace()
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    assert names == {0: "cpu 0", 1: "cpu 1", 1000: "host"}
    pytest.importorskip("matplotlib")
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
    sys.path.insert(0, os.path.normpath(bench))
    try:
        import plot_trace
    finally:
        sys.path.pop(0)
    labels = plot_trace.row_labels(trace)
    assert "CPU 0 compute" in labels and "CPU 1 weights" in labels and "host caller" in labels
    assert not any(label.startswith("GPU") for label in labels)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    subprocess.run([sys.executable, os.path.join(bench, "plot_trace.py"), str(path),
                    str(tmp_path / "trace.png")], check=True, timeout=120)
    assert (tmp_path / "trace.png").stat().st_size > 0
