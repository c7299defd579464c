"""`python -m ps_offload.admin ...` runs the ps-admin command line."""

from ps_offload.admin.cli import app

app()
