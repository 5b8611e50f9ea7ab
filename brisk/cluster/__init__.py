"""Scale-out on Ray Serve (`brisk serve --replicas N`); imported only when asked for, so
single-process serve never imports Ray."""
