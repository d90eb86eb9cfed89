"""The training room: the recipe, the loop, the objectives it trains and the checkpoints it writes
(see ARCHITECTURE.md for the map of rooms)."""
