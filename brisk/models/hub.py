"""Models from the Hugging Face Hub, as `vllm serve ORG/NAME` and `llama-server -hf ORG/NAME:QUANT`
take them: `brisk serve Qwen/Qwen3-0.6B` downloads the checkpoint (its config, tokenizer and
safetensors), `brisk serve bartowski/Qwen_Qwen3-0.6B-GGUF:Q4_K_M` the one GGUF of that type (a GGUF
repo without a tag: its Q4_K_M, or its only file).

Downloads go through `huggingface_hub` into brisk's cache (`$BRISK_CACHE/hub`): resumed after an
interruption, with its progress bars, `HF_TOKEN` for gated or private repos, `HF_ENDPOINT` for a
mirror, and `HF_HUB_OFFLINE=1` to use what is cached without the network. Anything that stops a
model from arriving is one ModelLoadError naming the repo and what to do. No torch here.
"""

from __future__ import annotations

import re
from pathlib import Path

from brisk.errors import ModelLoadError

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(:[A-Za-z0-9._-]+)?$")
# what brisk reads from a checkpoint repo (weights, config, tokenizer, chat template)
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
DEFAULT_GGUF_TYPE = "Q4_K_M"


def is_repo_id(name: str) -> bool:
    """ORG/NAME or ORG/NAME:QUANT, and not a path that exists here nor a file name."""
    return (bool(_REPO_ID.match(name)) and not Path(name).expanduser().exists()
            and not name.lower().endswith((".gguf", ".safetensors", ".bin", ".json")))


def fetch(name: str) -> tuple[Path, str]:
    """(local path, "hf-dir" | "gguf") of a Hub model, downloading what is not cached yet."""
    repo, _, wanted = name.partition(":")
    try:
        files = _repo_files(repo)
        ggufs = [f for f in files if f.lower().endswith(".gguf")]
        if wanted or (ggufs and not any(f.endswith(".safetensors") for f in files)):
            return _download_file(repo, _pick_gguf(repo, ggufs, wanted)), "gguf"
        if not any(f.endswith(".safetensors") for f in files):
            raise ModelLoadError(f"Hub repo {repo!r} has no .safetensors or .gguf weights brisk can read "
                                 f"({len(files)} files); pick a repo with safetensors or GGUF weights")
        return _download_checkpoint(repo), "hf-dir"
    except ModelLoadError:
        raise
    except Exception as e:  # huggingface_hub's and httpx's errors: one line that says what to do
        raise ModelLoadError(_explain(repo, e)) from None


def _hub_cache() -> Path:
    from brisk.cache_dir import cache_dir

    return cache_dir() / "hub"


def _repo_files(repo: str) -> list[str]:
    """The repo's files: listed by the Hub, or (offline, or the Hub unreachable) those in the cache."""
    import httpx
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.hf_api import RepoFile

    try:
        if not hub_reachable():  # no network: the cache at once, not huggingface_hub's retries (~24 s of them)
            raise OfflineModeIsEnabled("the Hugging Face Hub cannot be reached")
        return [f.path for f in HfApi().list_repo_tree(repo, recursive=True) if isinstance(f, RepoFile)]
    except (OfflineModeIsEnabled, httpx.ConnectError, httpx.TimeoutException):
        folder = Path(snapshot_download(repo, cache_dir=_hub_cache(), local_files_only=True))
        return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]


PROBE_TIMEOUT_S = 2.0  # how long brisk waits to learn whether the Hub's host answers at all


def hub_reachable() -> bool:
    """Whether the Hub (HF_ENDPOINT) accepts a TCP connection within PROBE_TIMEOUT_S: a name that does not resolve or a
    host that does not answer means offline now, before huggingface_hub retries with backoff."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _pick_gguf(repo: str, ggufs: list[str], wanted: str) -> str:
    if not ggufs:
        raise ModelLoadError(f"Hub repo {repo!r} has no .gguf file; drop the :{wanted} tag to use its safetensors")
    whole = [f for f in ggufs if not re.search(r"-\d{5}-of-\d{5}\.gguf$", f)]
    tag = (wanted or DEFAULT_GGUF_TYPE).lower()
    matches = [f for f in whole if re.search(rf"(^|[-._/]){re.escape(tag)}([-._]|\.gguf$)", f.lower())]
    if not wanted and not matches and len(whole) == 1:
        matches = whole
    if len(matches) != 1:
        shown = ", ".join(Path(f).name for f in ggufs[:12]) + (" ..." if len(ggufs) > 12 else "")
        split = " (brisk does not read GGUFs split into parts)" if wanted and not matches and ggufs != whole else ""
        what = f"no GGUF of type {tag.upper()}" if not matches else f"{len(matches)} GGUFs of type {tag.upper()}"
        raise ModelLoadError(f"Hub repo {repo!r} has {what}{split}; its GGUFs: {shown}; name one as {repo}:TYPE")
    return matches[0]


def _download_file(repo: str, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo, filename, cache_dir=_hub_cache()))


def _download_checkpoint(repo: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, cache_dir=_hub_cache(), allow_patterns=CHECKPOINT_FILES))


def _explain(repo: str, e: Exception) -> str:
    kind = type(e).__name__
    if kind in ("RepositoryNotFoundError",):
        return (f"Hub repo {repo!r} was not found (or is private); check the name, or set HF_TOKEN to a token "
                "that can read it")
    if kind == "GatedRepoError":
        return f"Hub repo {repo!r} is gated; accept its terms on the Hub and set HF_TOKEN to your access token"
    if kind in ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectError", "ConnectTimeout",
                "TimeoutException", "ReadTimeout"):
        return (f"model {repo!r} is not in brisk's cache ({_hub_cache()}) and the Hugging Face Hub cannot be reached "
                "(no network, or HF_HUB_OFFLINE=1); connect to the network, set HF_ENDPOINT to a mirror, or "
                "download the model and pass its directory or .gguf file (if it is a local path: it does not exist)")
    return f"cannot fetch Hub model {repo!r}: {kind}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
