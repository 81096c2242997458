"""Independent references every test compares against."""
