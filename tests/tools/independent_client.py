#!/usr/bin/env python3
"""An independent gRPC client for knapserve: Python grpcio (not our C++ code).

Generates Python message classes from proto/knapserve/v1/generation.proto with
protoc, then calls the server through grpcio's generic channel API:
  - knapserve.v1.Generation/Generate (server streaming) with a greedy request,
  - grpc.health.v1.Health/Check for "" and "knapserve.v1.Generation"
    (messages built by hand: the health proto is two tiny messages).
Prints one JSON object: the streamed ids and text, the final message, and the
health statuses. Usage: independent_client.py ADDRESS PROTO_DIR WORK_DIR PROMPT N
With an empty PROMPT only the health statuses are checked.
"""
import json
import subprocess
import sys

import grpc


def check_health(channel):
    """grpc.health.v1.Health/Check for liveness ("") and readiness."""
    check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    health = {}
    for service in ["", "knapserve.v1.Generation"]:
        name = service.encode()
        request_bytes = (b"\x0a" + bytes([len(name)]) + name) if name else b""
        reply = check(request_bytes, timeout=10)
        # HealthCheckResponse { ServingStatus status = 1; } SERVING = 1.
        health[service] = reply[1] if len(reply) >= 2 and reply[0] == 0x08 else 0
    return health


def reflected_services(channel):
    """Service names from server reflection (grpc.reflection.v1alpha), with
    the request built by hand: ServerReflectionRequest { list_services = 7 }."""
    info = channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=lambda b: b, response_deserializer=lambda b: b)
    names = []
    for reply in info(iter([b"\x3a\x00"]), timeout=10):
        for name in [b"knapserve.v1.Generation", b"knapserve.v1.Planner", b"grpc.health.v1.Health"]:
            if name in reply:
                names.append(name.decode())
    return names


def main():
    address, proto_dir, work_dir, prompt, max_new = sys.argv[1:6]
    subprocess.run(["protoc", "-I" + proto_dir, "--python_out=" + work_dir,
                    proto_dir + "/knapserve/v1/generation.proto"], check=True)
    sys.path.insert(0, work_dir)
    from knapserve.v1 import generation_pb2  # noqa: E402 (generated above)

    channel = grpc.insecure_channel(address)
    if not prompt:
        print(json.dumps({"health": check_health(channel)}))
        return
    generate = channel.unary_stream(
        "/knapserve.v1.Generation/Generate",
        request_serializer=generation_pb2.GenerateRequest.SerializeToString,
        response_deserializer=generation_pb2.GenerateResponse.FromString)
    request = generation_pb2.GenerateRequest(text=prompt, max_new_tokens=int(max_new),
                                             temperature=0.0, ignore_eos=True)
    ids, text, final, chunks = [], "", None, 0
    for response in generate(request, timeout=120):
        if response.HasField("chunk"):
            chunks += 1
            ids.extend(response.chunk.token_ids)
            text += response.chunk.text
        elif response.HasField("final"):
            final = response.final

    health = check_health(channel)
    services = reflected_services(channel)

    bad_code = None
    try:
        list(generate(generation_pb2.GenerateRequest(text=prompt, temperature=-1.0), timeout=10))
    except grpc.RpcError as error:
        bad_code = error.code().name

    print(json.dumps({
        "ids": ids, "text": text, "chunks": chunks,
        "finish_reason": generation_pb2.FinishReason.Name(final.finish_reason) if final else "",
        "completion_tokens": final.usage.completion_tokens if final else -1,
        "health": health, "bad_request_code": bad_code, "reflected_services": services,
    }))


if __name__ == "__main__":
    main()
