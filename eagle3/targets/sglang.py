"""SGLang as the target backend: hidden states of a tensor-parallel target (Kimi-K2.5 on 8 GPUs) for extraction.

    eagle3 sglang serve --config configs/kimi-k2.5.yaml      # the capture server in this terminal
    eagle3 sglang command --config configs/kimi-k2.5.yaml    # print its command line only
    eagle3 extract --config configs/kimi-k2.5.yaml target.sglang.url=http://127.0.0.1:30000

How the states travel (decided here, see eagle3.targets.sglang_dump and eagle3.targets.sglang_capture):
- The server is plain `sglang.launch_server` with eagle3's SGLang plugin (eagle3.targets.sglang_capture, found
  through the `sglang.srt.plugins` entry points of the Python that runs SGLang) switched on by the
  EAGLE3_SGLANG_* environment. In every scheduler process the model captures the residual streams entering the
  three aux layers (SGLang's own EAGLE-3 capture, ids translated with `eagle3.layer_ids.to_engine_ids` and read
  back to be sure), and the logits processor, which sees every prompt token's *post-norm final* state before it
  keeps only the last token, writes aux + final for each prompt as one safetensors file into a RAM-backed
  folder (`target.sglang.dump_dir`, /dev/shm). So all four states come out, as tensors, not as JSON floats: a
  token is 4 x hidden bf16 values (docs/kimi-k2.5.md), many times that as JSON text. (SGLang's `--enable-return-hidden-states` returns only
  the final state, `--enable-return-aux-hidden-states` only the aux states, both as JSON lists.)
- `SGLangTarget.capture` posts the token ids to `/generate` (one batched request, `max_new_tokens: 1`), then
  reads, validates and deletes each prompt's file. A prompt with images is sent with its pictures (`data:` URLs) and
  each image's token run collapsed to one placeholder; its dump also holds the merged input embeddings at its image
  tokens (the `Prompt` class: the ids sent, the ids the server's model holds, the image positions). The client and the server must share the folder (same
  machine); the preflight proves that with a probe prompt.

Why not an in-process `ModelRunner` as SpecForge does: for TP=8 that means 8 ranks of this program each
building SGLang internals (batch, memory pools, mlp-sync) by hand, which breaks on every SGLang bump. The
server keeps SGLang's public launch path and hooks two methods through SGLang's own plugin mechanism.

Tokens must not be dropped or split, and every sample is checked:
- radix cache: a prefix hit prefills only the rest of the prompt -> the command always has
  `--disable-radix-cache`, and a response with `cached_tokens > 0` is an error naming the sample;
- chunked prefill: a long prompt is prefilled in pieces -> `--chunked-prefill-size -1`; a piece never matches
  the prompt's file name (the sha256 of all its ids), so a split prompt is reported, never half-read;
- every dump is checked: token count and ids equal the prompt's, shapes [T, 3H] / [T, H], the server's layer
  ids equal this run's, values finite; `meta_info.prompt_tokens` must equal the prompt length.

Layer ids: eagle3 id k = input of decoder layer k. SGLang spells that k-1 for Llama-family models; for
DeepSeek/Kimi k-1 when the first id is 2 (read alike by 0.5.23 and earlier releases), else k (0.5.23's rule);
the plugin translates and verifies (sglang_capture.enable_capture).

The dump folder is cleaned on start (killed runs leave files) and on exit (atexit, and SIGTERM turned into a
normal exit); only eagle3's own file names are ever deleted.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shlex
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.config import ExtractConfig, SGLangSettings, TargetConfig
from eagle3.data.images import VisionInputs, data_url
from eagle3.engines.vllm_eval import collapse_image_tokens  # its owner: a script that runs without eagle3
from eagle3.layer_ids import ArchFamily, validate_layer_ids
from eagle3.precision import DTYPES
from eagle3.process import this_process
from eagle3.targets.base import Captured
from eagle3.targets.hf import MetaPositions
from eagle3.targets.info import TargetInfo, read_target_info
from eagle3.targets.mooncake import StoreAddress, StoreError, segment_bytes
from eagle3.targets.sglang_dump import (
    ENV_DUMP_DIR,
    ENV_FAMILY,
    ENV_LAYER_IDS,
    ENV_SEGMENT,
    DumpError,
    clean_dump_dir,
    dump_path,
    ensure_dump_dir,
    error_path,
    read_dump,
    remove_dump_dir,
    sequence_key,
    served_ids,
)
from eagle3.targets.sglang_flags import (  # noqa: F401 - the capture server's flags, re-exported for its users
    CONTEXT_MARGIN,
    capture_context,
    capture_env,
    capture_flags,
    check_launch_args,
    check_server_info,
    longest_prompt,
    prefill_graphs,
    target_flags,
)
from eagle3.targets.sglang_pool import ServerPool, server_gone
from eagle3.targets.sglang_server import (
    SGLangServer,
    check_plugin,
    exit_on_sigterm,
    http_json,
    log_tail,
    sglang_python,
    wait_healthy,
)
from eagle3.targets.sglang_store import LostStates, StoreHandover, server_segment, wire_bytes_per_token

log = logging.getLogger("eagle3")

DEFAULT_PORT = 30000
REFUSED_GRACE_S = 10.0
"""How long a server given by `target.sglang.url` may refuse connections (a restart) before that is an error:
nothing listening there is a wrong URL or a server not started, and waiting the whole startup timeout for it
(an hour by default) would hide that."""

def _target_info(target: TargetConfig) -> TargetInfo:
    """The target's config.json (eagle3.targets.info), with what to do when this machine cannot see it."""
    try:
        return read_target_info(target.path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"target.path={target.path!r}: no config.json there; the SGLang backend reads the target's shape "
            "from it, so the model folder must be visible on this machine") from None


def server_address(s: SGLangSettings, local_rank: int) -> tuple[str | None, Path]:
    """(url, dump folder) of this process's server: `target.sglang.url` itself, or, when it lists one server per
    process of a node, the entry of this node's process `local_rank` with its own folder `<dump_dir>/<local_rank>`
    (two clients of one dump folder would delete each other's dumps)."""
    if not isinstance(s.url, list):
        return s.url, Path(s.dump_dir).absolute()
    if not 0 <= local_rank < len(s.url):
        raise ValueError(f"target.sglang.url lists {len(s.url)} server(s) and this is process {local_rank} of its "
                         "node (LOCAL_RANK): give one URL per process of a node")
    return s.url[local_rank], (Path(s.dump_dir) / str(local_rank)).absolute()


def server_env(dump_dir: str | Path, layer_ids: list[int], family: ArchFamily,
               store: tuple[StoreAddress, int] | None = None) -> dict[str, str]:
    """The EAGLE3_SGLANG_* variables that switch the capture plugin on (inherited by SGLang's TP workers), and with
    `store` (its address, the bytes this server lends it) the EAGLE3_MOONCAKE_* ones of the Mooncake Store."""
    env = {
        ENV_DUMP_DIR: str(Path(dump_dir).absolute()),
        ENV_LAYER_IDS: json.dumps(list(layer_ids)),
        ENV_FAMILY: family,
    }
    if store is not None:
        env.update({**store[0].env(), ENV_SEGMENT: str(store[1])})
    return env


# ----------------------------------------------------------------------------------------------- the client
@dataclass
class Prompt:
    """One prompt as the capture server takes it and hands its states back."""

    sent: list[int]
    """The ids in the request: each image's token run collapsed to its one placeholder (SGLang's processor expands
    it again from the picture, as the HF processor did when the data was prepared)."""
    served: list[int]
    """The ids the server's model holds and names the dump by (sglang_dump.served_ids)."""
    images: list[str]
    image_positions: list[int] | None
    """The prompt's image token positions ([] for a text prompt), None where the samples hold no images."""
    key: str

    @classmethod
    def of(cls, ids: list[int], images: list[str], vision: VisionInputs | None, vocab_size: int) -> Prompt:
        if vision is None:
            return cls(ids, ids, [], None, sequence_key(ids))
        token = vision.image_token_id
        sent = collapse_image_tokens(ids, token)
        if sent.count(token) != len(images):
            raise ValueError(f"a prompt with {len(images)} images holds {sent.count(token)} runs of its image token "
                             f"{token}")
        served = served_ids(ids, token, vocab_size)
        return cls(sent, served, images, [i for i, t in enumerate(ids) if t == token], sequence_key(served))


def _distinct_keys(indices: list[int], prompts: list[Prompt]) -> list[list[int]]:
    """`indices` in requests whose prompts' dump names differ: prompts alike but for their pictures hold the same
    served ids, and one request would have them write one file."""
    parts: list[list[int]] = []
    for i in indices:
        for part in parts:
            if all(prompts[j].key != prompts[i].key for j in part):
                part.append(i)
                break
        else:
            parts.append([i])
    return parts


class SGLangTarget:
    """`TargetBackend` over SGLang servers: one launched here, or those running at `target.sglang.url`."""

    name = "sglang"
    dump_grace_s = 5.0
    """How long to wait for a dump the server should already have written (filesystem visibility only)."""
    lost_retries = 3
    """Times a request whose states were lost in the store is made again before that is an error."""

    def __init__(self, target: TargetConfig, extract: ExtractConfig, max_length: int, logs_dir: Path, *,
                 preflight: bool | None = None, startup_timeout_s: float | None = None, info: TargetInfo | None = None,
                 request: tuple[int, str] | None = None, images: bool = False):
        """max_length: data.max_length, the longest prompt it captures; logs_dir: where a server started here logs;
        request: (tokens of the largest request, the storage its states travel in), `request_shape` (default: an
        offline extraction's); images: the samples hold images (sent with their prompts; the target's processor
        names its image token)."""
        s = target.sglang
        self.target, self.max_length, self.logs_dir = target, max_length, logs_dir
        self.info = info or _target_info(target)
        self.num_layers = target.num_layers or self.info.num_layers
        self.hidden_size = self.info.hidden_size
        self.vocab_size = self.info.vocab_size
        self.family: ArchFamily = self.info.family
        self.layer_ids = target.layer_ids(self.num_layers)
        self.dtype: torch.dtype = DTYPES[target.dtype]
        self.vision = VisionInputs.required(target) if images else None
        # an M-RoPE target's positions, which the server does not hand back: computed here as the HF backend's are
        self._positions = MetaPositions(self.info.folder, self.vision) if self.vision and self.info.mrope else None
        self.timeout_s = s.timeout_s
        self.request_tokens, self.storage = request or (extract.batch_tokens, "exact")
        place = this_process()
        self.server: SGLangServer | None = None
        self.handover: StoreHandover | None = None
        self._own_dump_dir = False
        self._closed = False
        # Dumps are named by the prompt's tokens: two threads (online training's train and eval prefetchers) sending
        # the same prompt at once would read and delete each other's file, so one request is in flight at a time.
        self._lock = threading.Lock()
        self.log_file: Path | None = None
        urls = self._handover(s, place.rank, place.local_rank, place.world)
        ensure_dump_dir(self.dump_dir)
        if self.handover is None:
            n = clean_dump_dir(self.dump_dir)
            if n:
                log.info("removed %d stale dump file(s) from %s", n, self.dump_dir)
        atexit.register(self.close)
        exit_on_sigterm()

        startup_timeout_s = s.startup_timeout_s if startup_timeout_s is None else startup_timeout_s
        if urls[0]:
            given = [str(u).rstrip("/") for u in urls]
            log.info("using the SGLang server(s) at %s (%s)", ", ".join(given),
                     "states through the Mooncake Store" if self.handover else f"dump folder {self.dump_dir}")
            for u in given:
                wait_healthy(u, startup_timeout_s, refused_grace_s=REFUSED_GRACE_S)
        else:
            try:
                self._launch(startup_timeout_s)
            except BaseException:
                self.close()
                raise
            given = [self.url]
        self.url = given[0]
        self.pool = ServerPool(given, start=place.rank)
        if self.handover is None:
            clean_dump_dir(self.dump_dir)
        if extract.preflight if preflight is None else preflight:
            self.preflight()

    # -- lifecycle
    def _handover(self, s: SGLangSettings, rank: int, local_rank: int, world: int) -> list[str | None]:
        """How states come back (the dump folder, or the store with its reader) and the servers to ask."""
        if s.transport == "shm":
            url, self.dump_dir = server_address(s, local_rank)
            return [url]
        self.dump_dir = Path(s.dump_dir).absolute()  # a server launched here still dumps other clients' requests
        if world > s.mooncake.clients:
            raise StoreError(f"{world} processes ask the capture servers, target.sglang.mooncake.clients is "
                             f"{s.mooncake.clients}: raise it to {world} and restart the servers (their share of the "
                             "store is sized by it)")
        self.handover = StoreHandover(StoreAddress.of(s.mooncake), self.logs_dir, rank, self.storage)
        return list(s.url) if isinstance(s.url, list) else [s.url]

    def _launch(self, startup_timeout_s: float) -> None:
        self._own_dump_dir = True  # our own server: the folder is ours alone, removed on close
        check_plugin(sglang_python(), mooncake=self.handover is not None)
        self.log_file = self.logs_dir / f"sglang-capture-{os.getpid()}.log"
        store = None
        if self.handover is not None:
            s = self.target.sglang
            store = (self.handover.store.addr,
                     server_segment(s, self.hidden_size, self.target.dtype, (self.request_tokens, self.storage),
                                    images=self.vision is not None))
        self.server = SGLangServer(capture_flags(self.target, self.max_length, str(self.info.folder)),
                                   {**server_env(self.dump_dir, self.layer_ids, self.family, store),
                                    **capture_env(self.target, self.max_length, self.info)}, self.log_file,
                                   startup_timeout_s,
                                   what=f"the SGLang capture server (TP={self.target.sglang.tp_size})")
        self.url = self.server.url

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.handover is not None:
            if self.handover.lost or self.pool.failovers:
                log.info("SGLang capture: %d failover(s), %d request(s) made again for states lost in the store",
                         self.pool.failovers, self.handover.lost)
            self.handover.close()
        if self.server is not None:
            self.server.close()
        if self._own_dump_dir:
            remove_dump_dir(self.dump_dir)
        elif self.handover is None:
            clean_dump_dir(self.dump_dir)

    def __enter__(self) -> SGLangTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- capture
    def bytes_per_token(self) -> int:
        """Cache size per token: 3 aux + 1 final states of `hidden_size` values (Kimi's: docs/kimi-k2.5.md)."""
        return 4 * self.hidden_size * torch.tensor([], dtype=self.dtype).element_size()

    def capture(self, sequences: list[list[int]], images: list[list[str]] | None = None,
                names: list[str] | None = None) -> list[Captured]:
        """States for every token of every sequence, in order; errors name the sample (`names[i]` if given). With the
        `mooncake` transport they come in `request`'s storage (fp8 with their scales, when it says so). `images`:
        each sequence's images (eagle3.data.images references, in the order of its image tokens), sent with it;
        its states then hold the target's merged input embeddings at its image tokens."""
        if not sequences:
            return []
        seqs = [[int(t) for t in s] for s in sequences]
        if names is not None and len(names) != len(seqs):
            raise ValueError(f"capture: {len(names)} names for {len(seqs)} sequences")
        if images is not None and len(images) != len(seqs):
            raise ValueError(f"capture: {len(images)} image lists for {len(seqs)} sequences")
        if images is not None and any(images) and self.vision is None:
            raise ValueError("samples with images need SGLangTarget(..., images=True)")
        prompts = [Prompt.of(s, list(images[i]) if images is not None else [], self.vision, self.vocab_size)
                   for i, s in enumerate(seqs)]
        labels = names or [f"#{i} of this batch ({len(s)} tokens, key {p.key[:12]})" for i, (s, p) in
                           enumerate(zip(seqs, prompts, strict=True))]
        unique: dict[tuple[str, tuple[str, ...]], int] = {}
        for i, p in enumerate(prompts):
            if not seqs[i]:
                raise ValueError(f"sample {labels[i]}: empty token sequence")
            unique.setdefault((p.key, tuple(p.images)), i)  # identical prompts are sent (and dumped) once
        got: dict[int, Captured] = {}
        with self._lock:
            for part in _distinct_keys(list(unique.values()), prompts):
                order = [(prompts[i], labels[i]) for i in part]
                caps = self._from_store(order) if self.handover is not None else self._from_dumps(order)
                got.update(zip(part, caps, strict=True))
        if self._positions is not None:  # once per distinct prompt: duplicates share their Captured
            for i, c in got.items():
                c.positions = self._positions(seqs[i], prompts[i].images)
        return [got[unique[(p.key, tuple(p.images))]] for p in prompts]

    def _generate(self, url: str, prompts: list[Prompt], rids: list[str] | None = None) -> list[dict[str, Any]]:
        """One batched /generate of `prompts` (one new token each: the prefill is the work), their pictures as
        `data:` URLs (a server on another machine reads no local file); their responses."""
        body: dict[str, Any] = {"input_ids": [p.sent for p in prompts],
                                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        if any(p.images for p in prompts):
            body["image_data"] = [[data_url(r) for r in p.images] for p in prompts]  # [] for a text prompt
        if rids is not None:
            body["rid"] = rids
        resp = http_json("POST", f"{url}/generate", body, timeout=self.timeout_s)
        if isinstance(resp, dict):
            resp = [resp]
        if not isinstance(resp, list) or len(resp) != len(prompts):
            raise RuntimeError(f"/generate returned {type(resp).__name__} of length "
                               f"{len(resp) if isinstance(resp, list) else '?'} for {len(prompts)} prompts")
        return resp

    def _from_dumps(self, order: list[tuple[Prompt, str]]) -> list[Captured]:
        """The `shm` transport: each prompt's dump file, read, checked and deleted."""
        try:
            resp = self._generate(self.url, [p for p, _ in order])
            out = []
            for (p, label), r in zip(order, resp, strict=True):
                self._check_meta(r.get("meta_info") or {}, len(p.served), label)
                path = self._await_dump(p.key, label, len(p.served))
                out.append(read_dump(path, p.served, layer_ids=self.layer_ids, hidden_size=self.hidden_size,
                                     sample=label, dtype=self.dtype, image_positions=p.image_positions))
            return out
        finally:
            for p, _ in order:
                dump_path(self.dump_dir, p.key).unlink(missing_ok=True)

    def _from_store(self, order: list[tuple[Prompt, str]], url: str | None = None) -> list[Captured]:
        """The `mooncake` transport: the request names each prompt's key; the states are read from the store,
        checked and removed. A server that fails the request is failed over (`url` pins one: the preflight); states
        lost between the server's put and this read are asked for again (a whole request: nothing half-read)."""
        assert self.handover is not None
        lost = 0
        while True:
            self.handover.store.check_master()
            server = url or self.pool.pick()
            rids = self.handover.keys(len(order))
            try:
                resp = self._generate(server, [p for p, _ in order], rids)
            except Exception as e:
                self.handover.discard(rids)
                if url is None and server_gone(e):
                    self.pool.failed(server, e)
                    continue
                raise
            try:
                out = []
                for rid, (p, label), r in zip(rids, order, resp, strict=True):
                    self._check_meta(r.get("meta_info") or {}, len(p.served), label)
                    out.append(self.handover.read(rid, p.served, layer_ids=self.layer_ids,
                                                  hidden_size=self.hidden_size, sample=label, dtype=self.dtype,
                                                  server=server, image_positions=p.image_positions))
                return out
            except LostStates as e:
                lost += 1
                self.handover.lost += 1
                if lost > self.lost_retries:
                    raise DumpError(f"{e}, {lost} times in a row: the server at {server} does not hand states over "
                                    "through the Mooncake Store (started by `eagle3 sglang serve` with "
                                    "target.sglang.transport mooncake, and eagle3 with Mooncake installed in its Python?)"
                                    f"{log_tail(self.log_file, 15)}") from None
                log.warning("%s: the request is made again (%d so far)", e, self.handover.lost)
            finally:
                self.handover.discard(rids)

    def _check_meta(self, meta: dict[str, Any], n: int, label: str) -> None:
        cached = int(meta.get("cached_tokens") or 0)
        if cached:
            raise DumpError(f"sample {label}: SGLang reused {cached} cached prefix tokens, so only {n - cached} of "
                            f"{n} tokens were prefilled: start the server with --disable-radix-cache")
        pt = meta.get("prompt_tokens")
        if pt is not None and int(pt) != n:
            raise DumpError(f"sample {label}: SGLang counted {pt} prompt tokens, the sample has {n} "
                            f"(truncated by the server's context length?)")

    def _await_dump(self, key: str, label: str, n: int) -> Path:
        """The server writes before it answers; the grace period only covers slow filesystem visibility."""
        path, error = dump_path(self.dump_dir, key), error_path(self.dump_dir, key)
        t0 = time.monotonic()
        while not path.exists():
            if error.exists():
                why = error.read_text()
                error.unlink(missing_ok=True)
                raise DumpError(f"sample {label}: the server did not hand its states over: {why}")
            if time.monotonic() - t0 > self.dump_grace_s:
                raise DumpError(
                    f"sample {label}: no hidden-state dump for its {n} tokens appeared in {self.dump_dir}. Either the "
                    f"server does not run eagle3's capture plugin with {ENV_DUMP_DIR}={self.dump_dir} on this machine "
                    f"(eagle3 installed in SGLang's Python, the server started by `eagle3 sglang serve`), or the prompt "
                    f"was prefilled in pieces (start SGLang with --chunked-prefill-size -1 and --disable-radix-cache; "
                    f"`eagle3 sglang serve` does){log_tail(self.log_file, 15)}"
                )
            time.sleep(0.01)
        return path

    # -- preflight
    def preflight(self, sample: list[int] | None = None) -> None:
        """Before hours of extraction: ids valid for the depth, every server's flags, a probe's states checked twice
        through each (with the store: the server's share of it against what this run needs), then one prompt of
        data.max_length tokens, the largest prefill the run will ask for (its KV pool, its activations and the
        hand-over of its states: at 32K never met by a short probe)."""
        validate_layer_ids(self.layer_ids, self.num_layers, where="target.aux_layer_ids")
        probe = sample or [(17 + 7919 * i) % self.vocab_size for i in range(24)]
        longest = [(29 + 104729 * i) % self.vocab_size for i in range(self.max_length)]
        for url in self.pool.urls:
            self._check_server_info(url)
            t0 = time.monotonic()
            # Twice: the second identical prompt would hit a radix cache that the flags did not reveal.
            for attempt in ("probe", "repeated probe"):
                got = self._probe(url, probe, f"preflight {attempt}")
            via = "dump folder" if self.handover is None else self._check_segment(url)
            log.info("preflight ok: %s, %d tokens -> aux %s final %s, layers %s (%s family), %.1f s, %d bytes/token, "
                     "through the %s", url, len(probe), tuple(got.aux.shape), tuple(got.final.shape), self.layer_ids,
                     self.family, time.monotonic() - t0, self.bytes_per_token(), via)
            if len(longest) > len(probe):
                t0 = time.monotonic()
                self._probe(url, longest, f"preflight probe of data.max_length ({len(longest)} tokens)")
                log.info("preflight ok: %s took a data.max_length prompt (%d tokens) in %.1f s", url, len(longest),
                         time.monotonic() - t0)

    def _probe(self, url: str, ids: list[int], label: str) -> Captured:
        p = Prompt.of(ids, [], None, self.vocab_size)
        if self.handover is None:
            return self._from_dumps([(p, label)])[0]
        return self._from_store([(p, label)], url=url)[0]

    def _check_segment(self, url: str) -> str:
        """The store's room at `url`'s server against what this run's processes can leave waiting there at once."""
        assert self.handover is not None
        meta = self.handover.last_meta
        lent = int(meta.get("segment_bytes", "0"))
        world = this_process().world
        per_token = wire_bytes_per_token(self.hidden_size, self.target.dtype, self.storage, self.vision is not None)
        need = segment_bytes(world, self.request_tokens, per_token, margin=1.0)
        if lent < need:
            raise StoreError(
                f"preflight: the store is too small: the server at {url} lends {lent / 1e9:.2f} GB, and {world} "
                f"process(es) x {self.request_tokens} tokens per request x "
                f"{per_token} bytes per token need "
                f"{need / 1e9:.2f} GB when they all wait at one server: restart it with a larger "
                "target.sglang.mooncake.segment_gb (or clients, from which it is derived)")
        return f"Mooncake Store (segment {meta.get('segment')}, {lent / 1e9:.2f} GB lent, {self.storage} states)"

    def _check_server_info(self, url: str) -> None:
        check_server_info(url, self.target, self.max_length)


# ------------------------------------------------------------------------------------------------------ CLI
def serve(target: TargetConfig, max_length: int, port: int | None, host: str, dry_run: bool,
          local_rank: int | None = None, request: tuple[int, str] | None = None, images: bool = False) -> int:
    """`eagle3 sglang serve|command`: print the capture server's command line, then (serve) become that server.

    The port defaults to the one of `target.sglang.url` (its entry `local_rank` when it lists servers), else 30000.
    With the `mooncake` transport the server joins the store, lending `server_segment` bytes for `request` (the
    config's `request_shape`; `images`: the samples hold images), and checks at start that it can (the master up,
    Mooncake in SGLang's Python)."""
    s = target.sglang
    url, dump_dir = server_address(s, this_process().local_rank if local_rank is None else local_rank)
    if port is None:
        from urllib.parse import urlparse

        port = (urlparse(url).port if url else None) or DEFAULT_PORT
    info = _target_info(target)
    layer_ids = target.layer_ids(target.num_layers or info.num_layers)
    python = sglang_python()
    cmd = [python, "-m", "sglang.launch_server", *capture_flags(target, max_length, str(info.folder)), "--host", host,
           "--port", str(port)]
    store = None
    if s.transport == "mooncake":
        store = (StoreAddress.of(s.mooncake),
                 server_segment(s, info.hidden_size, target.dtype, request or (ExtractConfig().batch_tokens, "exact"),
                                images))
    env = {**server_env(dump_dir, layer_ids, info.family, store), **capture_env(target, max_length, info)}
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd), flush=True)
    if dry_run:
        return 0
    check_plugin(python, mooncake=store is not None)
    if store is not None:
        from eagle3.targets.mooncake import master_problem

        problem = master_problem(store[0])
        if problem:
            raise StoreError(problem)
        log.info("the server lends the Mooncake Store %.2f GB (target.sglang.mooncake: %d clients x %d tokens, or "
                 "segment_gb)", store[1] / 1e9, s.mooncake.clients, (request or (0,))[0])
    ensure_dump_dir(dump_dir)
    clean_dump_dir(dump_dir)
    os.execve(python, cmd, {**os.environ, **env})
    return 0  # not reached
