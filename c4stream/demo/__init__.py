"""``c4stream demo``: the whole pipeline on one machine, on a simulated job."""
