"""The docs against the code: settings, links and anchors, the README's length. Marker `docs`."""
