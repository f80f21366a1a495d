"""Examples that use the served recommender: the end-to-end demo (train, publish, serve, query)
and a client service that replays a data set's users as live sessions. They need the training
and data code, so they live outside the client package (`clients/`, numpy and tritonclient only)."""
