"""The front end: the public gRPC service, the OpenAI HTTP endpoint, routing and overload limits."""
