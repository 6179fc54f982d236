#!/usr/bin/env python3
"""The offline feature cache from any model transformers runs (Qwen3.5/3.6 GatedDeltaNet hybrids,
MoE targets, ...): the same format `cargo xtask features` writes (data/src/features.rs), so that
`cargo xtask train --features CACHE` trains from it.

usage:
  cargo xtask features --target DIR --data FILE... --export-documents docs.jsonl
  python3 xtask/scripts/features_transformers.py --target DIR --documents docs.jsonl --out CACHE \
      [--layer-ids 1,9,17,25,33] [--shard-gb 4] [--device cuda] [--dtype bfloat16]

The documents (tokens and loss masks, in the data set's order, with the data's provenance in the
first line) come from the Rust pipeline, so both writers cache the same tokens. Each document runs
alone (positions from 0); layer id l is the output of decoder layer l (a forward hook on it, never
the final-norm output). The cache's size is printed first and a disk too small refused. Shards
are written under a temporary name, synced and renamed (and their folder synced), then index.json;
a rerun continues after the last listed shard, writing again a listed shard that is missing or of
another size (and those after it). Non-finite features are refused, naming the document.
"""
import argparse
import errno
import fcntl
import hashlib
import json
import math
import os
import socket
import sys
import time

import numpy as np
import torch
import transformers

FORMAT = "dflash-features-1"
# Bytes of metadata per token in a shard: token u32, mask u8, document i64, position u32
# (META_BYTES_PER_TOKEN in data/src/features.rs).
META_BYTES_PER_TOKEN = 4 + 1 + 8 + 4


def sha256_files(paths):
    """sha256 of the files' bytes one after another."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def weight_files(target):
    """Every shard the index names (each once, in name order), or the single model.safetensors."""
    index_file = os.path.join(target, "model.safetensors.index.json")
    if not os.path.isfile(index_file):
        return [os.path.join(target, "model.safetensors")]
    with open(index_file) as f:
        names = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(target, n) for n in names]


def text_config(config):
    return getattr(config, "text_config", None) or config


def default_layer_ids(num_layers, n=5):
    """As `training_target_layer_ids` in reference/src/config.rs: spec section 1's rule (n == 1 ->
    [L/2]; else round(1 + i*(L-4)/(n-1)), halves to even as the upstream helper) where it gives n increasing
    layers up to L-2; else n layers spread evenly from 0 to L-2, each once (the last layer's
    output is not tapped: engines serve it after the final norm)."""
    top = num_layers - 2
    n = min(n, top + 1)
    if n == 1:
        rule = [num_layers // 2]
    else:
        rule = [int(round(1 + i * (num_layers - 4) / (n - 1))) for i in range(n)]
    if all(a < b for a, b in zip(rule, rule[1:])) and all(0 <= l <= top for l in rule):
        return rule
    return [int(math.floor(i * top / max(n - 1, 1) + 0.5)) for i in range(n)]


def decoder_layers(model, num_layers):
    """The ModuleList of decoder layers: the one named `layers` with num_layers entries."""
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise SystemExit(f"error: no decoder-layer list of {num_layers} layers in {type(model).__name__}")


def sync_folder(path):
    """Syncs the folder holding `path` (a rename is durable only once its folder is)."""
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def write_synced(path, data):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_folder(path)


class Documents:
    """The export's documents, read one at a time (a data set of a billion tokens does not fit in
    Python lists): the byte offset of each line is kept, the line parsed when asked for."""

    def __init__(self, path):
        self.file = open(path, "rb")
        self.header = json.loads(self.file.readline())
        if self.header.get("dflash_documents") != 1:
            raise SystemExit(f"error: {path}: not an export of `cargo xtask features --export-documents`")
        self.offsets = []
        while True:
            at = self.file.tell()
            line = self.file.readline()
            if not line:
                break
            if line.strip():
                self.offsets.append(at)
        if len(self.offsets) != self.header["documents"]:
            raise SystemExit(f"error: {path}: {len(self.offsets)} documents, the header says {self.header['documents']}")

    def __len__(self):
        return len(self.offsets)

    def __getitem__(self, i):
        self.file.seek(self.offsets[i])
        return json.loads(self.file.readline())


def gb(n):
    return f"{n / 1e9:.2f} GB"


def eta(elapsed, done, left):
    """As `eta` in trainer/src/metrics.rs."""
    if done == 0:
        return "-"
    s = round(elapsed / done * left)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--documents", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layer-ids", default="")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = p.parse_args()

    if not (math.isfinite(a.shard_gb) and a.shard_gb > 0):
        raise SystemExit(f"error: --shard-gb {a.shard_gb}: a positive size expected")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise SystemExit(f"error: --out {a.out}: exists and is not a folder")
    docs = Documents(a.documents)
    header = docs.header

    config = transformers.AutoConfig.from_pretrained(a.target)
    tc = text_config(config)
    num_layers, hidden = tc.num_hidden_layers, tc.hidden_size
    ids = [int(x) for x in a.layer_ids.split(",")] if a.layer_ids else default_layer_ids(num_layers)
    if not ids or any(l < 0 or l > num_layers - 2 for l in ids) or any(a >= b for a, b in zip(ids, ids[1:])):
        raise SystemExit(f"error: --layer-ids {ids}: increasing layers from 0 to {num_layers - 2} "
                         f"(the target has {num_layers}; its last is not tapped)")
    provenance = {
        "target_config": sha256_files([os.path.join(a.target, "config.json")]),
        "target_weights": sha256_files(weight_files(a.target)),
        "data": header["data"],
        "layer_ids": ",".join(str(l) for l in ids),
    }
    index = {"format": FORMAT, "provenance": provenance, "hidden_size": hidden, "layer_ids": ids,
             "shard_bytes": int(a.shard_gb * 1e9), "documents": len(docs), "tokens": header["tokens"], "shards": []}
    os.makedirs(a.out, exist_ok=True)
    # The cache's lock (the Rust writer's too): no two writers at once; held until the process ends.
    lock = open(os.path.join(a.out, ".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a live process holds its lock"
        raise SystemExit(f"error: {a.out} is in use by another run ({holder}): wait for it to end or stop it")
    except OSError as e:  # a filesystem without locks (Lustre's noflock, NFS without lockd)
        if e.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
            raise
        print(f"warning: {a.out}/.lock: {e}: locking is not supported here, so nothing stops a second "
              "writer of this cache", file=sys.stderr)
    lock.truncate(0)
    lock.write(f"process {os.getpid()} on {socket.gethostname()}")
    lock.flush()
    index_path = os.path.join(a.out, "index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            old = json.load(f)
        differ = [f"{k}: {old.get(k)!r} in the cache, {index[k]!r} now" for k in index
                  if k != "shards" and old.get(k) != index[k]]
        if differ:
            raise SystemExit(f"error: {index_path}: another cache ({'; '.join(differ)}); "
                             "the same options continue it, or choose another --out")
        index["shards"] = old["shards"]
    # A listed shard lost or cut short: it and those after it are written again (their contents
    # are a function of the documents and the shard size).
    for k, shard in enumerate(index["shards"]):
        path = os.path.join(a.out, shard["file"])
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size != shard["bytes"]:
            why = "cannot be read" if size is None else f"{size} bytes but the index lists {shard['bytes']}"
            for later in index["shards"][k:]:
                if os.path.isfile(os.path.join(a.out, later["file"])):
                    os.remove(os.path.join(a.out, later["file"]))
            index["shards"] = index["shards"][:k]
            print(f"{path}: {why}; writing it again from document {shard['first_doc']}", file=sys.stderr)
            break
    # The writer's own temporaries only (a shard's, the index's): nothing else of the folder.
    for name in os.listdir(a.out):
        if name == "index.json.tmp" or (name.startswith("shard-") and name.endswith(".safetensors.tmp")):
            os.remove(os.path.join(a.out, name))
    write_synced(index_path, json.dumps(index, indent=2).encode())
    width = len(ids) * hidden
    total = header["tokens"] * (2 * width + META_BYTES_PER_TOKEN)
    needed = max(total - sum(s["bytes"] for s in index["shards"]), 0)
    st = os.statvfs(a.out)
    free = st.f_bavail * st.f_frsize
    print(f"{len(docs)} documents, {header['tokens']} tokens; features of layers {ids} ({width} values per token, "
          f"bf16): {gb(total)} in all, {gb(needed)} still to write, {gb(free)} free at {a.out}", file=sys.stderr)
    if needed > free:
        raise SystemExit(f"error: {a.out}: the cache needs {gb(needed)} more but the disk has {gb(free)} free; "
                         f"free space or choose another --out")

    dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(a.target, dtype=dtype).to(a.device).eval()
    layers = decoder_layers(model, num_layers)
    captured = {}

    def hook(l):
        def f(module, args, output):
            captured[l] = (output[0] if isinstance(output, (tuple, list)) else output)[0]
        return f

    handles = [layers[l].register_forward_hook(hook(l)) for l in sorted(set(ids))]
    first = sum(s["docs"] for s in index["shards"])
    if first:
        print(f"continuing after document {first} ({len(index['shards'])} complete shards)", file=sys.stderr)
    buf = {"features": [], "tokens": [], "loss_mask": [], "doc_ids": [], "positions": [], "offsets": [0]}
    shard_first = first
    started = time.monotonic()
    for i in range(first, len(docs)):
        d = docs[i]
        ids_t = torch.tensor([d["input_ids"]], device=a.device)
        with torch.no_grad():
            model(input_ids=ids_t, use_cache=False)
        feats = torch.cat([captured[l] for l in ids], dim=-1).to(torch.bfloat16).cpu()
        finite = torch.isfinite(feats).all(dim=-1)
        if not bool(finite.all()):
            token = int((~finite).nonzero()[0][0])
            raise SystemExit(f"error: document {i}: the target's features hold NaN or Inf (token {token}): "
                             f"its weights or config")
        n = len(d["input_ids"])
        buf["features"].append(feats.view(torch.int16).numpy().view(np.uint16))
        buf["tokens"].append(np.array(d["input_ids"], dtype=np.uint32))
        buf["loss_mask"].append(np.array(d["loss_mask"], dtype=np.uint8))
        buf["doc_ids"].append(np.full(n, i, dtype=np.int64))
        buf["positions"].append(np.arange(n, dtype=np.uint32))
        buf["offsets"].append(buf["offsets"][-1] + n)
        full = sum(x.size for x in buf["features"]) * 2 >= index["shard_bytes"]
        if full or i + 1 == len(docs):
            name = f"shard-{len(index['shards']):05d}.safetensors"
            path = os.path.join(a.out, name)
            feats = np.concatenate(buf["features"]).reshape(-1, len(ids) * hidden)
            t = int(buf["offsets"][-1])
            tensors = [
                ("features", "BF16", [t, len(ids) * hidden], feats),
                ("doc_ids", "I64", [t], np.concatenate(buf["doc_ids"])),
                ("doc_offsets", "I64", [len(buf["offsets"])], np.array(buf["offsets"], dtype=np.int64)),
                ("tokens", "U32", [t], np.concatenate(buf["tokens"])),
                ("positions", "U32", [t], np.concatenate(buf["positions"])),
                ("loss_mask", "U8", [t], np.concatenate(buf["loss_mask"])),
            ]
            write_safetensors(path, tensors, {"format": FORMAT, "first_doc": str(shard_first)})
            docs_in = len(buf["offsets"]) - 1
            index["shards"].append({"file": name, "first_doc": shard_first, "docs": docs_in,
                                    "tokens": int(buf["offsets"][-1]), "bytes": os.path.getsize(path)})
            write_synced(index_path, json.dumps(index, indent=2).encode())
            elapsed = time.monotonic() - started
            print(f"shard {len(index['shards'])}: documents {shard_first}..{shard_first + docs_in} of {len(docs)}, "
                  f"{(i + 1 - first) / max(elapsed, 1e-9):.1f} documents/s, ETA {eta(elapsed, i + 1 - first, len(docs) - i - 1)}",
                  file=sys.stderr)
            shard_first += docs_in
            buf = {"features": [], "tokens": [], "loss_mask": [], "doc_ids": [], "positions": [], "offsets": [0]}
    for h in handles:
        h.remove()
    print(json.dumps({"out": a.out, "documents": len(docs), "shards": len(index["shards"])}))


def write_safetensors(path, tensors, metadata):
    """A safetensors file (header padded to 8 bytes, tensors in order, little-endian), written
    under a temporary name, synced and renamed. Features are bf16 bits held as uint16."""
    header, offset = {"__metadata__": metadata}, 0
    for name, dtype, shape, array in tensors:
        size = array.nbytes
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text.encode())
        for _, _, _, array in tensors:
            f.write(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    sync_folder(path)


if __name__ == "__main__":
    main()
