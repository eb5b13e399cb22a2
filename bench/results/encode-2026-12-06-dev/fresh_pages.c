#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <pthread.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
size_t N=680u<<20; char *buf; int T;
void* w(void*a){long i=(long)a; size_t per=N/T; memset(buf+i*per,1,per); return 0;}
int main(int c,char**v){T=atoi(v[1]);int huge=atoi(v[2]);
for(int r=0;r<3;r++){ buf=mmap(0,N,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0); if(huge) madvise(buf,N,MADV_HUGEPAGE);
double t=now(); pthread_t th[64]; for(long i=0;i<T;i++)pthread_create(&th[i],0,w,(void*)i); for(int i=0;i<T;i++)pthread_join(th[i],0);
double f=now()-t; t=now(); for(long i=0;i<T;i++)pthread_create(&th[i],0,w,(void*)i); for(int i=0;i<T;i++)pthread_join(th[i],0);
double s=now()-t; printf("T=%d huge=%d fresh %.3f s (%.2f GB/s), touched %.3f s (%.2f GB/s)\n",T,huge,f,N/f/1e9,s,N/s/1e9); munmap(buf,N);}
}
