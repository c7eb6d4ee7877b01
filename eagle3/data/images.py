"""Images in conversations: where they sit in a turn, which bytes they are, and the tokens a target's processor makes
of each.

    ref = image_ref("file:///data/a.png", base=None)      # -> "/data/a.png"; `data:` URLs are kept as they are
    digest = image_digest(ref)                             # sha256 of the bytes: the prepared fingerprint's part
    images = VisionInputs.of(target)                       # None for a text-only target
    text, spans = images.expand(text, spans, [ref])        # one placeholder -> the processor's count of tokens

A turn's `content` holds IMAGE_MARK where an image stands and `Turn.images` the images in that order (eagle3.data.
types). Chat templates get them as OpenAI content parts (`{"type": "image"}`), which every VLM template renders as
its placeholder (Kimi-K2.5: `<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`, Qwen2.5-VL:
`<|vision_start|><|image_pad|><|vision_end|>`); the target's processor owns how many tokens the one pad becomes
(K2.5: one per 2x2 group of 14 px patches, 448x448 -> 256). Image tokens are prompt: never in the loss, always in
the sequence.

References are local: a path (relative ones against `SourceConfig.image_dir`, default the source file's folder), a
`file://` URL or a `data:` URL. A remote URL is skipped (`image_remote_url`): a training run never fetches.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import mimetypes
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from eagle3.data.types import Turn

if TYPE_CHECKING:
    from eagle3.config import TargetConfig

IMAGE_MARK = "\ufffc"
"""Where an image stands in a turn's text (U+FFFC, the object replacement character; a source's own U+FFFC is
replaced by U+FFFD when read, so the mark is only ever eagle3's)."""

LLAVA_IMAGE = "<image>"
"""The LLaVA / ShareGPT-VL placeholder in a record's text, one per entry of its `images` (or `image`) field."""

_DATA_URL = re.compile(r"^data:(?P<mime>[\w/+.-]*)(?:;[\w=.-]+)*?(?P<b64>;base64)?,(?P<data>.*)$", re.S)


class ImageError(ValueError):
    """An image a record names that cannot be used; `reason` is the skip reason prepare counts."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def image_ref(url: Any, base: Path | None) -> str:
    """A record's image reference as eagle3 stores it: an absolute path or a `data:` URL."""
    if not isinstance(url, str) or not url.strip():
        raise ImageError("image_not_a_reference", f"{url!r} is not an image path or URL")
    url = url.strip()
    if url.startswith("data:"):
        return url
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https", "ftp", "s3", "gs"):
        raise ImageError("image_remote_url", f"{url[:120]} (training never fetches: download the images and point "
                         "to the files)")
    if parsed.scheme == "file":
        return str(Path(unquote(parsed.path)))
    p = Path(url).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    return str(p.absolute())


def image_bytes(ref: str) -> bytes:
    """The encoded bytes of an image reference (image_ref's output)."""
    if ref.startswith("data:"):
        m = _DATA_URL.match(ref)
        if m is None:
            raise ImageError("image_unreadable", f"malformed data URL {ref[:60]}...")
        try:
            return base64.b64decode(m["data"], validate=True) if m["b64"] else unquote(m["data"]).encode("latin-1")
        except (binascii.Error, ValueError) as e:
            raise ImageError("image_unreadable", f"data URL: {e}") from None
    try:
        return Path(ref).read_bytes()
    except FileNotFoundError:
        raise ImageError("image_missing", ref) from None
    except OSError as e:
        raise ImageError("image_unreadable", f"{ref}: {e}") from None


def data_url(ref: str) -> str:
    """The image as a `data:` URL (what an engine on another machine can read; SGLang's image_data takes them)."""
    if ref.startswith("data:"):
        return ref
    mime = mimetypes.guess_type(ref)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(image_bytes(ref)).decode()}"


def image_digest(ref: str) -> str:
    """sha256 of the image's bytes: two runs prepare the same samples only from the same pictures."""
    return hashlib.sha256(image_bytes(ref)).hexdigest()


def load_image(ref: str) -> Any:
    """The image as an RGB PIL image (what processors take); ImageError when it cannot be decoded."""
    from PIL import Image, UnidentifiedImageError

    data = image_bytes(ref)
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError("image_unreadable", f"{ref[:120]}: {e}") from None
    return img.convert("RGB")


def check_image(ref: str) -> None:
    """Raise ImageError when the image is missing or cannot be decoded (read time: a bad image skips its record)."""
    load_image(ref)


# ------------------------------------------------------------------------------------------------ records
def has_mark(value: Any) -> bool:
    if isinstance(value, str):
        return IMAGE_MARK in value
    if isinstance(value, list):
        return any(has_mark(v) for v in value)
    return isinstance(value, dict) and any(has_mark(v) for v in value.values())


def replace_marks(value: Any) -> Any:
    """A source's own U+FFFC (eagle3's image mark) as U+FFFD."""
    if isinstance(value, str):
        return value.replace(IMAGE_MARK, "\ufffd")
    if isinstance(value, list):
        return [replace_marks(v) for v in value]
    return {k: replace_marks(v) for k, v in value.items()} if isinstance(value, dict) else value


IMAGE_PARTS = ("image_url", "image", "input_image")


def part_image(part: dict[str, Any], images_in: Path | None) -> str:
    """An OpenAI `image_url` part (`{"url": ...}` or the URL itself), or the `image` / `input_image` shapes other
    clients send (`"image"`, `"image_url"`, `"url"` or `"path"` holding the path or URL)."""
    url = part.get(part["type"])
    if url is None:
        url = part.get("image_url", part.get("url", part.get("path")))
    if isinstance(url, dict):
        url = url.get("url")
    return image_ref(url, images_in)


def with_llava_images(turns: list[Turn], body: dict[str, Any], images_in: Path | None) -> list[Turn]:
    """The LLaVA / ShareGPT-VL shape: `<image>` in the text, the files in the record's `images` (or `image`), in
    order. Counts that differ skip the record (`image_count_mismatch`); without such a field `<image>` is text."""
    listed = body.get("images", body.get("image"))
    listed = [] if listed is None else [listed] if isinstance(listed, str) else listed
    if not isinstance(listed, list):
        raise ImageError("image_not_a_reference", f"`images` is {type(listed).__name__}, not a list")
    if not listed:
        return turns
    marks = sum(t.content.count(LLAVA_IMAGE) for t in turns)
    if marks != len(listed):
        raise ImageError("image_count_mismatch", f"{marks} {LLAVA_IMAGE} in the text for {len(listed)} images")
    refs = iter([image_ref(x, images_in) for x in listed])
    out = []
    for t in turns:
        n = t.content.count(LLAVA_IMAGE)
        if n and t.role == "assistant":
            raise ImageError("image_in_assistant_turn", "an answer cannot hold an image")
        if n:
            t = t.with_(content=t.content.replace(LLAVA_IMAGE, IMAGE_MARK), images=tuple(next(refs) for _ in range(n)))
        out.append(t)
    return out


# ------------------------------------------------------------------------------------------------ the processor
def _has_vision_tower(path: str) -> bool:
    from eagle3.targets.info import read_target_info

    try:
        return "vision_config" in read_target_info(path).config
    except (OSError, ValueError):
        return False


@dataclass
class VisionInputs:
    """A vision-language target's processor, as prepare and extraction use it: the text placeholder its chat template
    writes for one image, and the tokens it expands each image to."""

    processor: Any
    image_token: str
    image_token_id: int
    _counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, target: TargetConfig) -> VisionInputs | None:
        """The target's processor when it takes images, else None (a text-only target). A target whose config has a
        vision tower but whose processor does not load is an error naming why (torchvision missing, most often),
        never a text-only target that would skip every image record."""
        from eagle3.bundled import resolve_target_path

        try:
            from transformers import AutoProcessor

            proc = AutoProcessor.from_pretrained(resolve_target_path(target.path), revision=target.revision,
                                                 trust_remote_code=target.trust_remote_code)
        except (OSError, ValueError, TypeError, KeyError, ImportError, AttributeError) as e:
            if _has_vision_tower(target.path):
                raise RuntimeError(f"target.path={target.path!r} has a vision tower (vision_config), but its processor "
                                   f"does not load: {e}. Vision-language processors need torchvision (pip install "
                                   "torchvision, the build that matches your torch)") from e
            return None
        vision = cls.from_processor(proc)
        if vision is None and _has_vision_tower(target.path):
            raise RuntimeError(f"target.path={target.path!r} has a vision tower (vision_config), but its processor "
                               f"({type(proc).__name__}) has no image processor or image token")
        return vision

    @classmethod
    def required(cls, target: TargetConfig) -> VisionInputs:
        """`of`, for work that has images: a target that takes none is an error naming it."""
        vision = cls.of(target)
        if vision is None:
            raise ValueError(f"target.path={target.path!r} takes no images (no image processor)")
        return vision

    @classmethod
    def from_processor(cls, proc: Any) -> VisionInputs | None:
        token = getattr(proc, "image_token", None)
        if getattr(proc, "image_processor", None) is None or not isinstance(token, str):
            return None
        tok = proc.tokenizer
        token_id = getattr(proc, "image_token_id", None)
        if token_id is None:
            token_id = tok.convert_tokens_to_ids(token)
        return cls(proc, token, int(token_id))

    def inputs(self, refs: list[str]) -> dict[str, Any]:
        """The processor's image tensors for these images (pixel values, grids), for the target's forward."""
        return dict(self.processor.image_processor([load_image(r) for r in refs], return_tensors="pt"))

    def count(self, ref: str) -> int:
        """How many tokens the processor makes of this image's one placeholder (cached by reference)."""
        if ref not in self._counts:
            enc = self.processor(text=[self.image_token], images=[load_image(ref)])
            ids = enc["input_ids"][0]
            self._counts[ref] = int(sum(1 for i in ids if int(i) == self.image_token_id))
        return self._counts[ref]

    def expand(self, text: str, spans: list[tuple[int, int]], refs: list[str]
               ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text with each image's one placeholder repeated to its token count, and the loss spans
        moved with it. The rendered text must hold exactly one placeholder per image."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(refs):
            raise ImageError("image_count_mismatch", f"the chat template wrote {len(pieces) - 1} image placeholders "
                             f"({self.image_token}) for {len(refs)} images")
        out = [pieces[0]]
        at = len(pieces[0])  # where the next placeholder starts in the rendered text
        shifts: list[tuple[int, int]] = []  # (position in the rendered text, characters added before it)
        added = 0
        for piece, ref in zip(pieces[1:], refs, strict=True):
            n = self.count(ref)
            out.append(self.image_token * n + piece)
            added += len(self.image_token) * (n - 1)
            at += len(self.image_token)
            shifts.append((at, added))
            at += len(piece)

        def moved(pos: int) -> int:
            extra = 0
            for p, a in shifts:
                if pos >= p:
                    extra = a
            return pos + extra

        return "".join(out), [(moved(s), moved(e)) for s, e in spans]


def images_identity(per_sample: list[tuple[str, ...]] | list[list[str]]) -> str:
    """sha256 over every sample's images, each by its bytes' digest: what the prepared fingerprint adds for them."""
    h = hashlib.sha256()
    for refs in per_sample:
        h.update(b"\x01")
        for ref in refs:
            h.update(image_digest(ref).encode())
    return h.hexdigest()


def as_files(images: list[list[str]], folder: Path) -> list[list[str]]:
    """Image references (per prompt) as absolute file paths a process without eagle3 opens (vLLM's): a `data:` URL
    written out, as its bytes, into `folder`."""
    folder.mkdir(exist_ok=True)
    out = []
    for i, refs in enumerate(images):
        files = []
        for j, ref in enumerate(refs):
            if ref.startswith("data:"):
                path = folder / f"{i}-{j}.img"
                path.write_bytes(image_bytes(ref))
                ref = str(path)
            files.append(str(Path(ref).resolve()))
        out.append(files)
    return out
