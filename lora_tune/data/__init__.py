"""The data room: sources, formats, chat rendering, tokenizing and its cache, batching and packing
(see ARCHITECTURE.md for the map of rooms)."""
