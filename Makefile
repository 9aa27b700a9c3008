# The two commands of the README. Each installs what it needs and builds.
.PHONY: run test gpu-check clean

run:
	scripts/setup.sh
	./build/moestash info
	./build/moestash train

test:
	scripts/test.sh

gpu-check:
	scripts/gpu-check.sh

clean:
	rm -rf build build-asan build-gpu
