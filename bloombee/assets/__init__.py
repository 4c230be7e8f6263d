"""Package data: the embedded default models (bloombee-tiny, bloombee-tiny-draft)."""
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
