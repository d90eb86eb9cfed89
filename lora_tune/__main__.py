from lora_tune.cli import entry

entry()
