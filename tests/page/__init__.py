"""The chat page in headless Chromium (Playwright) against a live server. Marker `page`."""
