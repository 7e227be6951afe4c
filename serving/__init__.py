"""Ray Serve application serving a target + drafter pair (see serving/app.py)."""
