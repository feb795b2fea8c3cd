"""`forge engine` one step at a time: checkpoint -> engine directory, its manifest and build key."""
