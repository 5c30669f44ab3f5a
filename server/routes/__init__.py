"""The HTTP endpoints, one module per family; server/app.py maps paths to them."""
