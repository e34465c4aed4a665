"""bench/'s own tools, tested by importing them: the serving benchmark's client, metrics, SSE reader and report are
checked piece by piece (their numbers and tables, on recorded streams), which a command line cannot show; and the GPU
check's bundle and rehearsal. The only tests that import bench/. Marker `bench`."""
