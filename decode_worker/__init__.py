"""decode_worker: see ../shared/ARCHITECTURE.md; built by a later issue."""
