"""``python -m classify.seq2seq``: see ``classify.seq2seq.cli``."""

import sys

from ..errors import run_cli
from .cli import main

sys.exit(run_cli(main, prog="classify.seq2seq"))
