#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into tests/fuzz/corpus/<target>/.

    python3 tests/fuzz/make_corpus.py build/libroundpipe.so

The checkpoints come from the library itself (rp_model_save, rp_model_save_hf through ctypes,
any build of it); the other seeds (dtype variants, shards and their index, bundles for
fuzz_hf_dir) are assembled here with the standard library only. The output is deterministic:
the models use fixed seeds. Run it again after a change of the fixed models in fuzz_load.cpp or
fuzz_hf_dir.cpp, and commit the result.
"""
import ctypes
import json
import os
import shutil
import struct
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")
SEPARATOR = b"#rp-fuzz-file#\n"  # fuzz_hf_dir.cpp

# fuzz_load.cpp's fixed model.
LOAD_SPEC = json.dumps({"layers": [
    {"type": "linear", "in": 5, "out": 9},
    {"type": "layer_norm", "dim": 9},
    {"type": "residual_mlp", "dim": 9, "hidden": 13},
    {"type": "embedding", "num": 7, "dim": 3},
    {"type": "linear", "in": 3, "out": 2, "bias": False}]})

# fuzz_hf_dir.cpp's fixed config (its kConfig), then variants for create_from_hf.
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 16, "hidden_size": 8,
         "intermediate_size": 12, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 4, "tie_word_embeddings": False,
         "dtype": "float32"}
LLAMA_TIED = {"architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 8,
              "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "tie_word_embeddings": True, "torch_dtype": "float32",
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
LLAMA3_ROPE = dict(LLAMA_TIED, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                   num_hidden_layers=1, max_position_embeddings=64, torch_dtype="bfloat16",
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 16})
QWEN3_F16 = dict(QWEN3, dtype="float16", hidden_act="silu", rms_norm_eps=1e-6,
                 rope_scaling={"rope_type": "linear", "factor": 2.0},
                 use_sliding_window=False, attention_dropout=0.0, initializer_range=0.02,
                 layer_types=["full_attention"])
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 16, "hidden_size": 8,
             "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": [1], "output_router_logits": False,
             "router_aux_loss_coef": 0.001, "dtype": "float32"}

SPECS = [
    {"layers": [{"type": "linear", "in": 8, "out": 16}, {"type": "gelu"},
                {"type": "linear", "in": 16, "out": 1}]},
    {"layers": [{"type": "embedding", "num": 10, "dim": 4}, {"type": "layer_norm", "dim": 4,
                                                             "eps": 1e-5},
                {"type": "flatten", "start_dim": 1}, {"type": "linear", "in": 12, "out": 3,
                                                      "bias": False}]},
    {"layers": [{"type": "rms_norm", "dim": 6, "eps": 1e-6}, {"type": "relu"}, {"type": "silu"},
                {"type": "tanh"}, {"type": "gelu", "approximate": "tanh"},
                {"type": "dropout", "p": 0.1}, {"type": "reshape", "shape": [-1, 3]}]},
    {"layers": [{"type": "residual_mlp", "dim": 4, "hidden": 8},
                {"type": "residual_mlp", "dim": 4, "hidden": 6, "activation": "silu",
                 "norm": "rms_norm", "eps": 1e-6},
                {"type": "residual_mlp", "dim": 4, "hidden": 5, "activation": "relu",
                 "norm": "none"}]},
    {"layers": [{"type": "token_embedding", "num": 16, "dim": 8, "init_std": 0.02},
                {"type": "decoder_layer", "dim": 8, "heads": 2, "kv_heads": 1, "head_dim": 4,
                 "hidden": 12, "eps": 1e-6, "qk_norm": True, "rope_theta": 10000.0},
                {"type": "decoder_layer", "dim": 8, "heads": 2, "hidden": 12,
                 "attention_bias": True, "mlp_bias": True, "rope_type": "llama3",
                 "rope_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                 "rope_original_max_positions": 16},
                {"type": "rms_norm", "dim": 8},
                {"type": "lm_head", "dim": 8, "vocab": 16, "tied_to": "0.weight",
                 "chunk_tokens": 4}]},
    {"layers": [{"type": "linear", "in": 4, "out": 4, "bias": True, "hiden": 3}]},
    {"layers": [{"type": "linear", "in": -3, "out": 2}]},
]


def lib_open(path):
    lib = ctypes.CDLL(os.path.abspath(path))
    P = ctypes.c_void_p
    lib.rp_last_error_message.restype = ctypes.c_char_p
    lib.rp_model_options_create.argtypes = [ctypes.POINTER(P)]
    lib.rp_model_options_set_devices.argtypes = [P, ctypes.c_int32, ctypes.c_int32]
    lib.rp_model_options_set_seed.argtypes = [P, ctypes.c_uint64]
    for fn in ("rp_model_create", "rp_model_create_from_hf_config"):
        getattr(lib, fn).argtypes = [ctypes.POINTER(P), ctypes.c_char_p, P]
    for fn in ("rp_model_save", "rp_model_save_hf"):
        getattr(lib, fn).argtypes = [P, ctypes.c_char_p]
    lib.rp_model_destroy.argtypes = [P]
    return lib


def call(lib, status, what):
    if status != 0:
        sys.exit(f"{what} failed ({status}): {lib.rp_last_error_message().decode()}")


def options(lib, seed):
    o = ctypes.c_void_p()
    call(lib, lib.rp_model_options_create(ctypes.byref(o)), "rp_model_options_create")
    call(lib, lib.rp_model_options_set_devices(o, 1, 1), "rp_model_options_set_devices")
    call(lib, lib.rp_model_options_set_seed(o, seed), "rp_model_options_set_seed")
    return o


def saved(lib, create, text, save, seed, tmp, name):
    """Build a model with `create` from `text`, save it with `save`; returns the path."""
    m = ctypes.c_void_p()
    call(lib, getattr(lib, create)(ctypes.byref(m), text.encode(), options(lib, seed)), create)
    path = os.path.join(tmp, name)
    call(lib, getattr(lib, save)(m, path.encode()), save)
    lib.rp_model_destroy(m)
    return path


# ---- safetensors, read and written here ----------------------------------------------------

def st_read(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    meta = header.pop("__metadata__", None)
    tensors = {}
    for name, t in header.items():
        b, e = t["data_offsets"]
        tensors[name] = (t["dtype"], t["shape"], body[b:e])
    return tensors, meta


def st_bytes(tensors, meta=None):
    header, body = {}, b""
    if meta is not None:
        header["__metadata__"] = meta
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(body), len(body) + len(raw)]}
        body += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + body


def convert(tensors, dtype):
    """F32 tensors to F16 / BF16 / F64."""
    out = {}
    for name, (src, shape, raw) in tensors.items():
        assert src == "F32", src
        vals = struct.unpack(f"<{len(raw) // 4}f", raw)
        if dtype == "F16":
            raw2 = struct.pack(f"<{len(vals)}e", *vals)
        elif dtype == "F64":
            raw2 = struct.pack(f"<{len(vals)}d", *vals)
        else:  # BF16: the upper half of each float32
            raw2 = b"".join(raw[i + 2:i + 4] for i in range(0, len(raw), 4))
        out[name] = (dtype, shape, raw2)
    return out


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def bundle(config, index=None, weights=()):
    parts = [config.encode() if isinstance(config, str) else config,
             index.encode() if isinstance(index, str) else (index or b"")]
    parts += list(weights)
    return SEPARATOR.join(parts)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    lib = lib_open(sys.argv[1])
    for t in ("fuzz_spec", "fuzz_hf_config", "fuzz_hf_dir", "fuzz_load"):
        shutil.rmtree(os.path.join(CORPUS, t), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix="rp-corpus-")
    try:
        for i, spec in enumerate(SPECS):
            write("fuzz_spec", f"spec_{i}.json", json.dumps(spec))

        configs = {"qwen3": QWEN3, "llama_tied": LLAMA_TIED, "llama3_rope": LLAMA3_ROPE,
                   "qwen3_f16": QWEN3_F16, "qwen3_moe": QWEN3_MOE}
        for name, cfg in configs.items():
            write("fuzz_hf_config", f"{name}.json", json.dumps(cfg))

        # fuzz_load: the fixed model's checkpoint, in four dtypes, and a file with an extra
        # tensor and metadata.
        st, meta = st_read(saved(lib, "rp_model_create", LOAD_SPEC, "rp_model_save", 3, tmp,
                                 "load.safetensors"))
        write("fuzz_load", "f32", st_bytes(st, meta))
        for dtype in ("F16", "BF16", "F64"):
            write("fuzz_load", f"{dtype.lower()}", st_bytes(convert(st, dtype)))
        extra = dict(st, unused=("I64", [2], struct.pack("<2q", 1, 2)))
        write("fuzz_load", "extra_tensor_and_metadata", st_bytes(extra, {"format": "pt"}))

        # fuzz_hf_dir: the fixed config's checkpoint, single file and in two shards with an
        # index; then other configs with their own checkpoints.
        d = saved(lib, "rp_model_create_from_hf_config", json.dumps(QWEN3), "rp_model_save_hf",
                  4, tmp, "qwen3")
        st, meta = st_read(os.path.join(d, "model.safetensors"))
        with open(os.path.join(d, "config.json"), "rb") as f:
            saved_config = f.read()
        write("fuzz_hf_dir", "qwen3_single", bundle(b"", None, [st_bytes(st, meta)]))
        write("fuzz_hf_dir", "qwen3_saved_config", bundle(saved_config, None, [st_bytes(st, meta)]))
        names = sorted(st)
        shards = [{n: st[n] for n in names[0::2]}, {n: st[n] for n in names[1::2]}]
        shard_names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        index = {"metadata": {"total_size": sum(len(t[2]) for t in st.values())},
                 "weight_map": {n: shard_names[i % 2] for i, n in enumerate(names)}}
        write("fuzz_hf_dir", "qwen3_sharded",
              bundle(b"", json.dumps(index), [st_bytes(shards[0], meta), st_bytes(shards[1])]))
        mixed = [convert(shards[0], "BF16"), convert(shards[1], "F16")]
        write("fuzz_hf_dir", "qwen3_sharded_bf16_f16",
              bundle(b"", json.dumps(index), [st_bytes(mixed[0]), st_bytes(mixed[1])]))
        for name, cfg in (("llama_tied", LLAMA_TIED), ("llama3_rope", LLAMA3_ROPE)):
            d = saved(lib, "rp_model_create_from_hf_config", json.dumps(cfg), "rp_model_save_hf",
                      5, tmp, name)
            with open(os.path.join(d, "model.safetensors"), "rb") as f:
                weights = f.read()
            write("fuzz_hf_dir", name, bundle(json.dumps(cfg), None, [weights]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for t in sorted(os.listdir(CORPUS)):
        files = os.listdir(os.path.join(CORPUS, t))
        size = sum(os.path.getsize(os.path.join(CORPUS, t, f)) for f in files)
        print(f"{t}: {len(files)} seeds, {size} bytes")


if __name__ == "__main__":
    main()
