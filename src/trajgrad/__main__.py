"""``python -m trajgrad ...`` (also what ``torchrun -m trajgrad train ...`` runs)."""
from .cli import main

main()
