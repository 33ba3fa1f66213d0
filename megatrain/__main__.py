"""``python -m megatrain``: the ``megatrain`` command (what ``torchrun -m megatrain`` runs on each rank)."""

from megatrain.cli import main

raise SystemExit(main())
