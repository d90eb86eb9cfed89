"""What a run trains: one module per objective family and the registry the recipe and the loop read."""
