"""A silo's side of a run: its round, what it accepts, its kept model, its privatisers."""
