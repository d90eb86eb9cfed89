"""The engine seam: one module per backend (`single`, `deepspeed`, `fsdp`), each declaring its
`SPEC` and implementing `Engine`; `registry` reads the specs (see ARCHITECTURE.md)."""
