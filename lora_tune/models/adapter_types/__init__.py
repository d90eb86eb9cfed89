"""peft's adapter types lora-tune trains (--peft-type): one module per type, registered in
`registry.TYPES`. Each module says how --rank/--alpha/--dropout map to the type's own knobs and
builds its peft config; nothing outside this room compares type names."""
