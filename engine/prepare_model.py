"""`python -m engine.prepare_model`: convert the embedded default model once (what `make serve` runs first)."""
import argparse
import logging
import os

from .config import default_cache_dir
from .model_store import prepare_default_model

logger = logging.getLogger(__name__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache-dir", default=os.environ.get("LOCKSTEP_CACHE_DIR") or default_cache_dir())
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logger.info("default model ready at %s", prepare_default_model(args.cache_dir))


if __name__ == "__main__":
    main()
