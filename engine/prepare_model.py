"""`python -m engine.prepare_model [--gguf FILE]`: prepare a GGUF once into the cache folder (the embedded default
without --gguf: what `make serve` runs first). Exits non-zero, with one line, for a file lockstep will not serve."""
import argparse
import logging
import os
import sys

from .config import default_cache_dir
from .model_store import UnsupportedModel, find_gguf, prepare_gguf_model

logger = logging.getLogger(__name__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache-dir", default=os.environ.get("LOCKSTEP_CACHE_DIR") or default_cache_dir())
    parser.add_argument("--gguf", help="the GGUF file (default: the embedded model's)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        logger.info("model ready at %s", prepare_gguf_model(args.gguf or str(find_gguf()), args.cache_dir))
    except UnsupportedModel as exc:
        logger.critical("%s", exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
