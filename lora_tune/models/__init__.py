"""The model room: everything about the base model and the adapter on it, from a name to loaded,
adapted weights (see ARCHITECTURE.md for the map of rooms)."""
